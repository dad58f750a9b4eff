"""A prepared check for one GPU: its matmul rate, one training step predicted against measured,
and the chapters' rank code run with its ranks on that GPU.

    python bench/gpu.py                   # on CUDA (expected: a few minutes on one H200)
    python bench/gpu.py --device cpu      # the same checks as a dry run: about 30 s on 2 cores
    python bench/gpu.py --sections ranks --cases pipeline.rank_step --worlds 2  # one check

Three tables:

1. ``matmul``: the best matmul rate over every (m, n, k) of a few sizes, per dtype (bf16,
   fp32 with TF32 off), median of repeats, with its spread
   (:func:`parlib.measure.matmul_rate.measure_matmul_rate`).
2. ``step``: one single-device training step of a model sized for the device, predicted by
   the cost model (``estimate`` on a device whose peak is the fp32 matmul rate just
   measured) against measured (median of repeats).
3. ``ranks``: each of the chapters' rank functions (``parlib.experiments``) run on one rank
   with NCCL and the rank's tensors on the GPU, and on two ranks with gloo and CPU tensors.
   One GPU can check no more than that: NCCL refuses two ranks on one GPU, and gloo's TCP
   transport cannot move CUDA tensors point to point (tried on an H200: ``writev ... Bad
   address`` in 8 of 13 functions), so the two-rank rows check the code paths of a
   multi-rank run, not the GPU. Every function that fails is listed with the first line of
   its error. On the CPU dry run both use gloo and CPU tensors. One of them,
   ``nccl_rules.rank_nccl_rules``, runs the pipeline's four schedules, ring attention and
   the experts' all-to-all inside :func:`parlib.comm.nccl_rules` against one device, and on
   NCCL a batch of messages the rank sends itself, matched in order (skipped on gloo, which
   cannot send to its own rank).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import parlib
from parlib.cost import Hardware, Layout, Link, Model, estimate
from parlib.measure.matmul_rate import MatmulRate, measure_matmul_rate
from parlib.model import ModelConfig, build_model, make_batch, train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int
           ) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _spread(values: list[float]) -> float:
    """Interquartile range over the median."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


# --------------------------------------------------------------------------- 1. matmul


def matmul_rates(device: torch.device, sizes: tuple[int, ...], repeats: int
                 ) -> list[MatmulRate]:
    """The best matmul rate over every (m, n, k) of ``sizes``, in bf16 and in fp32
    (:func:`parlib.measure.matmul_rate.measure_matmul_rate`)."""
    shapes = list(itertools.product(sizes, repeat=3))
    return [measure_matmul_rate(shapes, dtype=dtype, repeats=repeats, device=device.type)
            for dtype in ("bfloat16", "float32")]


def matmul_table(rates: list[MatmulRate]) -> str:
    lines = [f"{'dtype':<9} {'best m x n x k':>20} {'TFLOP/s':>9} {'spread':>7}"]
    for r in rates:
        shape = " x ".join(map(str, r.shape))
        lines.append(f"{r.dtype:<9} {shape:>20} {r.flops_per_second / 1e12:>9.3f} "
                     f"{r.spread:>7.0%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- 2. one step


def _memory_of(device: torch.device) -> dict[str, float]:
    """The datasheet memory bandwidth (and its achievable fractions) of a GPU the presets
    know, so the cost model charges the memory-bound operations; none on the CPU."""
    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device)
    for generation, preset in (("H200", Hardware.dgx_h200), ("H100", Hardware.dgx_h100),
                               ("A100", Hardware.dgx_a100)):
        if generation in name:
            hw = preset(1)
            return {"memory_bandwidth": hw.memory_bandwidth,
                    "memory_efficiency": hw.memory_efficiency,
                    "streaming_efficiency": hw.streaming_efficiency}
    return {}


def step_check(cfg: ModelConfig, batch: int, device: torch.device, fp32_rate: float,
               repeats: int) -> dict[str, float]:
    """One device's training step (fp32, Adam): the cost model's time at ``fp32_rate``
    (and, on a GPU the presets know, its memory bandwidth) against the measured median."""
    model = build_model(cfg, 0).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in make_batch(batch, cfg, 0, 0))
    seconds = _timed(lambda: train_step(model, optimizer, x, y), device, repeats, warmup=2)
    no_link = Link(alpha=0.0, bandwidth=math.inf)  # one device: nothing is sent
    one = Hardware(n_devices=1, devices_per_node=1, memory_bytes=math.inf,
                   peak_flops=fp32_rate, intra_node=no_link, inter_node=no_link,
                   name="this device at its fp32 matmul rate", **_memory_of(device))
    predicted = estimate(Model.from_config(cfg), one, Layout(), m=1, global_batch=batch,
                         mixed_precision=False, sequence_parallel=False, dp_overlap=False)
    return {"params": Model.from_config(cfg).n_params, "tokens": batch * cfg.seq_len,
            "predicted": predicted.step_time, "measured": statistics.median(seconds),
            "memory_bound": predicted.time.get("memory_bound", 0.0),
            "spread": _spread(seconds)}


def step_table(cfg: ModelConfig, result: dict[str, float]) -> str:
    ratio = result["measured"] / result["predicted"]
    return (f"model: h={cfg.d_model}, L={cfg.n_layers}, s={cfg.seq_len}, "
            f"{result['params'] / 1e6:.1f} M parameters, {result['tokens']} tokens per step; "
            f"predicted memory-bound part {result['memory_bound']:.4f} s\n"
            f"{'predicted s':>12} {'measured s':>11} {'spread':>7} {'measured/predicted':>19}\n"
            f"{result['predicted']:>12.4f} {result['measured']:>11.4f} "
            f"{result['spread']:>7.0%} {ratio:>19.2f}")


# --------------------------------------------------------------------------- 3. rank code


SMALL = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
SMALL_MOE = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2,
                        n_experts=4, top_k=2)


def _layouts(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib import verify
    from parlib.experiments import layouts as L

    runs = ((L.Run(Layout(), m=1),) if world == 1 else
            (L.Run(Layout(dp=2), m=1), L.Run(Layout(tp=2), m=1), L.Run(Layout(pp=2), m=2)))
    return L.rank_time_layouts, (runs,), dict(cfg=SMALL, flops_per_second=None,
                                              reference=verify.reference_step(SMALL),
                                              repeats=1, warmup=0)


def _combined(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import combined

    layout = Layout() if world == 1 else Layout(dp=1, tp=1, pp=2)
    return combined.rank_train_3d, (layout,), dict(cfg=SMALL, steps=1)


def _combined_tp(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import combined

    layout = Layout() if world == 1 else Layout(tp=2)
    return combined.rank_train_3d, (layout,), dict(cfg=SMALL, steps=1)


def _pipeline(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import pipeline

    return pipeline.rank_step, (SMALL,), dict(schedule_name="1f1b", m=2, warmup=0)


def _pipeline_schedule(name: str) -> Callable[[int], tuple[Callable[..., Any], tuple, dict]]:
    """The schedule lab's other runner paths: interleaved chunks, ZB-H1's split backward."""
    def make(world: int) -> tuple[Callable[..., Any], tuple, dict]:
        from parlib.experiments import pipeline

        # SMALL's 4 blocks make 2 chunks of 2 on one rank, 4 chunks of 1 on two
        return pipeline.rank_step, (SMALL,), dict(schedule_name=name, m=2, warmup=0)
    return make


def _torch_pipelining(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import torch_pipelining

    return torch_pipelining.rank_torch_pipelining, (SMALL,), dict(m=2, repeats=1, warmup=0)


def _ledger(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import sharded

    return sharded.ledger_run, (sharded.STAGES, SMALL, 4), dict(steps=1)


def _fsdp2(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import sharded

    return sharded.fsdp2_run, (SMALL, 4), dict(steps=1, repeats=1)


def _attention(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import context

    return context.attention_check, ("ring",), dict(seq_len=8 * world)


def _context_train(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import context

    return context.train_split_model, (SMALL,), dict(steps=1, batch=2)


def _experts(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import experts

    return experts.train_expert_parallel, (SMALL_MOE, world), dict(steps=1, batch=4)


def _expert_traffic(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import experts

    return experts.layer_traffic, (SMALL_MOE,), dict(tokens=8, capacity_factors=(None, 1.0))


def _nccl_rules(world: int) -> tuple[Callable[..., Any], tuple, dict]:
    from parlib.experiments import nccl_rules

    # SMALL's 4 blocks: 2 chunks per rank for the interleaved schedule on up to two ranks
    return nccl_rules.rank_nccl_rules, (SMALL, SMALL_MOE), dict(m=2)


# Rank functions that need at least two ranks (a pipeline of one stage is refused by
# torch.distributed.pipelining itself, whatever the device).
NEEDS_TWO = {"torch_pipelining.rank_torch_pipelining"}

CASES: dict[str, Callable[[int], tuple[Callable[..., Any], tuple, dict]]] = {
    "layouts.rank_time_layouts": _layouts,
    "combined.rank_train_3d (p=2)": _combined,
    "combined.rank_train_3d (t=2)": _combined_tp,
    "pipeline.rank_step": _pipeline,
    "pipeline.rank_step (interleaved)": _pipeline_schedule("interleaved"),
    "pipeline.rank_step (zb-h1)": _pipeline_schedule("zb-h1"),
    "torch_pipelining.rank_torch_pipelining": _torch_pipelining,
    "sharded.ledger_run": _ledger,
    "sharded.fsdp2_run": _fsdp2,
    "context.attention_check": _attention,
    "context.train_split_model": _context_train,
    "experts.train_expert_parallel": _experts,
    "experts.layer_traffic": _expert_traffic,
    "nccl_rules.rank_nccl_rules": _nccl_rules,
}


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # RankError puts the failing rank and the cause first; keep the line naming the cause
    for line in lines:
        if "Error" in line or "error" in line or "not supported" in line.lower():
            return line[:160]
    return lines[0][:160]


def run_case(name: str, world: int, device: torch.device, timeout: float) -> tuple[str, str]:
    """("ok" | "FAIL", detail) of one case on ``world`` ranks: NCCL for one rank on a GPU,
    else gloo with the ranks' tensors on ``device``."""
    make = CASES[name]
    try:
        fn, args, kwargs = make(world)
    except Exception as err:  # noqa: BLE001 (a case that cannot be set up is listed)
        return "FAIL", f"setup: {_first_line(err)}"
    # NCCL and the GPU for one rank; two ranks on one GPU: gloo and the CPU (see the top)
    backend = "nccl" if device.type == "cuda" and world == 1 else "gloo"
    start = time.perf_counter()
    try:
        results = parlib.launch(fn, *args, world_size=world, backend=backend,
                                timeout=timeout, **kwargs)
    except Exception as err:  # noqa: BLE001 (every failure is listed, not raised)
        return "FAIL", _first_line(err)
    took = f"{time.perf_counter() - start:.1f} s"
    if fn.__name__ == "rank_time_layouts":  # it checks itself against one device
        from parlib.experiments import layouts as L

        rows = L.measured(results)
        if not all(r["ok"] for r in rows):
            worst = max(r["worst"] for r in rows)
            return "FAIL", f"gradients differ from one device's (largest {worst:.1e})"
        return "ok", f"{took}, gradients match one device's"
    if fn.__name__ == "rank_nccl_rules":  # a verdict per check, on every rank
        return _rules_verdict(results, took)
    return "ok", took


def _rules_verdict(results: list[dict[str, str]], took: str) -> tuple[str, str]:
    """The checks of :func:`parlib.experiments.nccl_rules.rank_nccl_rules` on every rank:
    FAIL naming each that failed, else ok with how many passed and which were skipped."""
    failed = sorted({f"{name}: {v[6:]}" for r in results for name, v in r.items()
                     if v.startswith("FAIL")})
    if failed:
        return "FAIL", "; ".join(failed)[:300]
    skipped = sorted({name for r in results for name, v in r.items() if v != "ok"})
    passed = len(results[0]) - len(skipped)
    return "ok", (f"{took}, {passed} checks under NCCL's rules equal one device"
                  + (f" (skipped: {', '.join(skipped)})" if skipped else ""))


def ranks_table(rows: list[tuple[str, int, str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'function':<{width}} {'ranks':>5} {'backend, tensors':<16} {'result':<6} detail"]
    lines += [f"{n:<{width}} {w:>5} {b:<16} {s:<6} {d}" for n, w, b, s, d in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"), help="cpu: a quick dry run of every check")
    ap.add_argument("--sections", nargs="+", choices=("matmul", "step", "ranks"),
                    default=["matmul", "step", "ranks"])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                    help="ranks: which rank functions to run")
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2],
                    help="ranks: world sizes to run each function on")
    ap.add_argument("--timeout", type=float, default=120.0, help="ranks: seconds per launch")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu for the dry run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"device: {name}; torch {torch.__version__}; "
          f"{'full run' if on_gpu else 'dry run (small sizes)'}")
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the course's checks)
        torch.backends.cudnn.allow_tf32 = False

    fp32_rate = None
    if "matmul" in args.sections or "step" in args.sections:
        sizes = (2048, 4096, 8192) if on_gpu else (64, 128, 256)
        rates = matmul_rates(device, sizes, repeats=10 if on_gpu else 3)
        fp32_rate = rates[1].flops_per_second
        if "matmul" in args.sections:
            print("\nmatmul rate (fp32 without TF32; best of every m, n, k in "
                  f"{', '.join(map(str, sizes))}):")
            print(matmul_table(rates))
    if "step" in args.sections:
        cfg = (ModelConfig(vocab_size=256, seq_len=1024, d_model=2048, n_heads=16, n_layers=8)
               if on_gpu else ModelConfig())
        batch = 8
        assert fp32_rate is not None
        print("\none training step, fp32, Adam: cost model at the fp32 matmul rate above "
              "against measured:")
        print(step_table(cfg, step_check(cfg, batch, device, fp32_rate, 10 if on_gpu else 3)))
    failures = 0
    if "ranks" in args.sections:
        rows = []
        for world in args.worlds:
            for case in args.cases:
                if world < 2 and case in NEEDS_TWO:
                    continue
                on_nccl = on_gpu and world == 1
                status, detail = run_case(case, world, device, args.timeout)
                failures += status != "ok"
                rows.append((case, world, "nccl, cuda" if on_nccl else "gloo, cpu", status,
                             detail))
                print(f"  {case} on {world} rank(s): {status}", flush=True)
        print(f"\nrank code ({failures} failing of {len(rows)}):")
        print(ranks_table(rows))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
