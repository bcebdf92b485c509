from common.model_key import model_key
from common.zoo import ModelSpec


def test_model_key_is_stable_and_tells_models_apart():
    a = ModelSpec(name="mlp", options={"hidden": 64, "depth": 2})
    b = ModelSpec(name="mlp", options={"depth": 2, "hidden": 64})
    assert model_key(a) == model_key(b)
    assert model_key(a) != model_key(ModelSpec(name="mlp", options={"hidden": 64, "depth": 3}))
    assert model_key(a) != model_key(ModelSpec(name="mlp", num_classes=5, options=a.options))
    assert model_key(ModelSpec(name="mlp", options={"x": 1})) != model_key(
        ModelSpec(name="mlp", options={"x": "1"})
    )
