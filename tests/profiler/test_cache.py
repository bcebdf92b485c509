from common.profile import LayerProfile, Profile
from services.profiler.cache import load_reusable, profile_key, save


def profile(batch_sizes: list[int], device: str = "dev-a", created: float = 1.0) -> Profile:
    n = len(batch_sizes)
    return Profile(
        model="m(num_classes=10)",
        device=device,
        batch_sizes=batch_sizes,
        layers=[
            LayerProfile(
                index=0,
                forward_s=[0.001] * n,
                backward_s=[0.002] * n,
                output_bytes=64,
                activation_bytes=128,
                param_bytes=256,
                optimizer_bytes=256,
            )
        ],
        created=created,
    )


def test_saved_where_the_planner_reads_and_indexed_by_device(store):
    key = save(store, profile([1, 2], created=5.0))
    assert key == profile_key("m(num_classes=10)", "dev-a") == "m(num_classes=10):dev-a"
    assert store.get_json("profile", key) == profile([1, 2], created=5.0).model_dump(mode="json")
    save(store, profile([1], device="dev-b"))
    assert store.get_fields("profiles", "m(num_classes=10)") == {"dev-a": 5.0, "dev-b": 1.0}


def test_reused_only_when_every_wanted_batch_size_was_measured(store):
    assert load_reusable(store, "m(num_classes=10)", "dev-a", [1]) is None
    save(store, profile([1, 2, 4]))
    for wanted in ([], [1, 2, 4], [4, 2], [2]):
        assert load_reusable(store, "m(num_classes=10)", "dev-a", wanted) == profile([1, 2, 4])
    assert load_reusable(store, "m(num_classes=10)", "dev-a", [1, 8]) is None
    assert load_reusable(store, "m(num_classes=10)", "dev-b", []) is None


def test_an_invalid_stored_profile_is_measured_again(store):
    store.put_json(
        {"model": "m(num_classes=10)", "device": "dev-a"}, "profile", "m(num_classes=10):dev-a"
    )
    assert load_reusable(store, "m(num_classes=10)", "dev-a", []) is None
