"""What a CUDA GPU gives a worker here: its description, profile, plan and speed (`make gpu-check`).

On a machine with a GPU (after the cuda-marked tests): the accelerator as a
worker describes it; the profiler's profile of small_cnn on the GPU and on the
CPU; the plan the asteroid planner makes from those profiles for the GPU beside
two CPU devices; how far single-process training on the GPU lands from the
same training on the CPU (the floor of any mixed job's bound); and samples/s
of a one-device stage runner on the GPU against one on the CPU, per model.
Results go to OUT/gpu_check.json and a readable OUT/gpu_check.md. Each part
runs on its own: one failing is reported and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from common.accelerator import (
    CPU,
    AcceleratorInfo,
    accelerator_budget,
    describe_accelerator,
    full_precision,
)
from common.device import device_fingerprint, memory_budget
from common.embedded_redis import EmbeddedRedis
from common.job import JobSpec
from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from common.store import Store
from common.zoo import ModelSpec, build_model
from services.planner.cost import CostModel
from services.planner.registry import get_planner
from services.profiler.layers import profile_model
from tests.gpu import exact_cuda
from tests.reference import reference_train, weight_difference
from tests.worker.local_pipeline import LocalPipeline

SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
CPU_THREADS = 4
"""Threads of the CPU side: a Pi-class device's cores, and what the CPU workers get."""
CPU_BUDGET = 2 << 30


def _profile(accelerator: AcceleratorInfo, threads: int) -> Profile:
    torch.set_num_threads(threads)
    budget = accelerator_budget(accelerator, memory_budget())
    return profile_model(
        ModelSpec(name="small_cnn"),
        [8, 32, 128],
        repeats=5,
        warmup=2,
        memory_budget=budget,
        accelerator=accelerator,
        device=device_fingerprint(threads, 0, accelerator=accelerator),
    )


def _layer_table(prof: Profile) -> list[dict[str, Any]]:
    return [
        {
            "layer": lp.index,
            "name": lp.name,
            **{
                f"fwd+bwd_ms@{b}": round((lp.forward_s[j] + lp.backward_s[j]) * 1e3, 4)
                for j, b in enumerate(prof.batch_sizes)
            },
        }
        for lp in prof.layers
    ]


def _plan(gpu: Profile, cpu: Profile, gpu_budget: int) -> Plan:
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name="gpu", memory_bytes=gpu_budget, profile="gpu"),
            DeviceSpec(name="cpu-a", memory_bytes=CPU_BUDGET, profile="cpu"),
            DeviceSpec(name="cpu-b", memory_bytes=CPU_BUDGET, profile="cpu"),
        ],
        bandwidth=125e6,
    )
    cost = CostModel({"gpu": gpu, "cpu": cpu}, cluster)
    return get_planner("asteroid").plan(cost, global_batch=64, microbatches=4)


def _optimizer_steps(device: torch.device) -> dict[str, float]:
    """Max-abs difference between the same optimizer steps on `device` and on the CPU.

    Replicas of one stage on a GPU and on a CPU receive the same summed
    gradients and step on their own: they stay bit-identical (as the replica
    digests require) only if the elementwise step rounds alike on both.
    """
    out = {}
    for kind in ("sgd", "adam", "adamw"):
        gen = torch.Generator().manual_seed(0)
        start = torch.randn(4096, generator=gen)
        grads = [torch.randn(4096, generator=gen) for _ in range(3)]
        finals = []
        for on in (torch.device("cpu"), device):
            p = torch.nn.Parameter(start.clone().to(on))
            spec = {"sgd": {"momentum": 0.9}, "adam": {}, "adamw": {}}[kind]
            opt_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
            opt = opt_cls[kind]([p], lr=0.05, weight_decay=1e-4, **spec)
            for g in grads:
                p.grad = g.clone().to(on)
                opt.step()
            finals.append(p.detach().cpu())
        out[kind] = float((finals[0] - finals[1]).abs().max())
    return out


def _samples_per_s(
    url: str, model: str, compute: torch.device, threads: int, rounds: int, batch: int
) -> float:
    """Samples/s of one stage runner holding the whole model on `compute` (after warm-up)."""
    torch.set_num_threads(threads)
    store = Store(url, f"gpu-check-{uuid.uuid4().hex[:8]}")
    job = JobSpec.model_validate(
        {"job_id": "speed", "model": {"name": model}, "seed": 1, "optimizer": SGD, "rounds": 1000}
    )
    depth = len(build_model(ModelSpec(name=model), 0).layers)
    stages = [{"start": 0, "end": depth, "devices": [{"device": "one"}]}]
    plan = Plan(global_batch=batch, microbatches=4, stages=stages)
    pipe = LocalPipeline(store, job, plan, compute=compute)
    for r in range(2):  # warm-up: allocator growth, cuDNN's algorithm choice
        pipe.run("run_round", r)
    if compute.type == "cuda":
        torch.cuda.synchronize(compute)
    t0 = time.perf_counter()
    for r in range(2, 2 + rounds):
        pipe.run("run_round", r)  # ends with a loss read back: the GPU's work is done
    elapsed = time.perf_counter() - t0
    store.close()
    return rounds * batch / elapsed


def main(argv: list[str] | None = None) -> int:
    """Run every part, write the results, exit 1 if any part failed or there is no GPU."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench-results/gpu"))
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per speed measurement")
    ap.add_argument(
        "--accelerator",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: every part on the CPU as if it were the GPU (a smoke test of this script)",
    )
    ap.add_argument("--models", default="small_cnn,resnet18", help="models timed for samples/s")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"host": platform.node(), "torch": torch.__version__}
    failed: list[str] = []

    def part(name: str, fn: Callable[[], Any]) -> Any:
        print(f"== {name}", flush=True)
        try:
            value = fn()
        except Exception:
            failed.append(name)
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], flush=True)
            return None
        results[name] = value
        shown = value.device if isinstance(value, Profile) else value
        print(json.dumps(shown, indent=2, default=str), flush=True)
        return value

    gpu = part("accelerator", lambda: asdict(describe_accelerator(args.accelerator)))
    if gpu is None:
        _write(args.out, results, failed)
        return 1
    info = describe_accelerator(args.accelerator)
    full_precision(info)  # float32 as a worker computes it
    gpu_budget = accelerator_budget(info, memory_budget())
    results["gpu_budget_bytes"] = gpu_budget
    gpu_prof = part("gpu_profile", lambda: _profile(info, torch.get_num_threads()))
    cpu_prof = part("cpu_profile", lambda: _profile(CPU, CPU_THREADS))
    if isinstance(gpu_prof, Profile) and isinstance(cpu_prof, Profile):
        results["gpu_profile"] = {
            "device": gpu_prof.device,
            "layers": _layer_table(gpu_prof),
        }
        results["cpu_profile"] = {
            "device": cpu_prof.device,
            "layers": _layer_table(cpu_prof),
        }
        print(json.dumps(results["gpu_profile"], indent=2), flush=True)
        part(
            "plan_gpu_beside_two_cpus",
            lambda: _plan(gpu_prof, cpu_prof, gpu_budget).model_dump(mode="json"),
        )

    def gpu_vs_cpu_training() -> dict[str, Any]:
        torch.set_num_threads(CPU_THREADS)
        exact = exact_cuda() if info.kind == "cuda" else contextlib.nullcontext()
        with exact:  # deterministic cuDNN, as the cuda-marked tests run
            cpu_w, cpu_l = reference_train({"name": "small_cnn"}, 7, 32, 5, SGD, device=CPU.device)
            gpu_w, gpu_l = reference_train({"name": "small_cnn"}, 7, 32, 5, SGD, device=info.device)
        key, diff = weight_difference(gpu_w, cpu_w)
        loss = max(abs(a - b) for a, b in zip(gpu_l, cpu_l, strict=True))
        return {"rounds": 5, "max_abs_weight_diff": diff, "worst_key": key, "max_loss_diff": loss}

    part("single_process_gpu_vs_cpu", gpu_vs_cpu_training)
    part("optimizer_step_gpu_vs_cpu_max_abs", lambda: _optimizer_steps(info.device))
    with EmbeddedRedis() as redis_server:
        for model in args.models.split(","):

            def speed(model: str = model, batch: int = 64) -> dict[str, float]:
                g = _samples_per_s(redis_server.url, model, info.device, 1, args.rounds, batch)
                c = _samples_per_s(
                    redis_server.url, model, CPU.device, CPU_THREADS, args.rounds, batch
                )
                return {"gpu_samples_s": g, "cpu_samples_s": c, "speedup": g / c}

            part(f"samples_per_s_{model}", speed)
    _write(args.out, results, failed)
    return 1 if failed else 0


def _write(out: Path, results: dict[str, Any], failed: list[str]) -> None:
    results["failed"] = failed
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    lines = ["# GPU check", ""]
    for name, value in results.items():
        lines += [f"## {name}", "", "```", json.dumps(value, indent=2, default=str), "```", ""]
    (out / "gpu_check.md").write_text("\n".join(lines))
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}; failed: {failed or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
