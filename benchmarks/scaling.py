"""How a training step's time grows with samples per prompt, completion length and model size.

One method's steps (`sdpo` by default) on the starter's math task through `measure` of
benchmarks/step_time.py (4 prompts per step), along three axes, the others held at the
starter's values (4 samples, 48 new tokens, the embedded model):

- samples per prompt: 2, 4, 8;
- max new tokens: 16, 48, 96;
- model size: models with the embedded model's tokenizer and architecture (Llama, vocabulary
  49,152): two built from a config (hidden 128 x 2 layers, 256 x 4), the embedded model cut to
  its first 4 and 12 layers, and the whole embedded model (30 layers, 134.5M parameters).

`use_reference_solution` gives every failed rollout a teacher, so every step trains whatever
the rollouts are (a random or cut model never succeeds). A cut or random model rarely emits EOS,
so its rollouts run to the token cap: the tokens generated per step are printed with each row.

    python benchmarks/scaling.py --steps 3 --plot docs/img/step-scaling.svg

Prints a table (seconds per step, mean of the steps after the first, with the phase split) and
writes the plot: one panel per axis.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AXES = {
    "samples per prompt": [2, 4, 8],
    "max new tokens": [16, 48, 96],
    "model": ["config 128x2", "config 256x4", "embedded, 4 layers", "embedded, 12 layers",
              "embedded"],
}
DEFAULTS = {"samples per prompt": 4, "max new tokens": 48, "model": "embedded"}


def step_time_module() -> Any:
    spec = importlib.util.spec_from_file_location("step_time", HERE / "step_time.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def model_loader(name: str) -> Any:
    """A function of the run's accelerator giving (model, tokenizer) for an axis value."""
    def load(dist: Any) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM

        model, tokenizer = dist.load_model("smollm2-135m")
        if name == "embedded":
            return model, tokenizer
        if name.startswith("embedded, "):
            layers = int(name.split()[1])
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
            return model, tokenizer
        hidden, layers = (int(x) for x in name.split()[1].split("x"))
        config = model.config.__class__.from_dict({
            **model.config.to_dict(), "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 4 * hidden, "num_attention_heads": hidden // 64,
            "num_key_value_heads": max(1, hidden // 128), "head_dim": 64})
        torch.manual_seed(0)
        small = AutoModelForCausalLM.from_config(config).to(model.device, model.dtype)
        small.generation_config = model.generation_config
        return small, tokenizer

    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="sdpo")
    ap.add_argument("--steps", type=int, default=3, help="steps per point (the first is a "
                    "warm-up)")
    ap.add_argument("--axes", default=",".join(AXES), help="comma-separated axes to measure")
    ap.add_argument("--plot", type=Path, default=None, help="write the plot (SVG) here")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    step_time = step_time_module()
    params = {"use_reference_solution": True} if args.method.startswith(("sdpo",
                                                                            "stable")) else {}
    results: dict[str, list[tuple[Any, dict]]] = {}
    print(f"# {args.method}, {torch.get_num_threads()} threads, 4 prompts per step; seconds "
          "per step: mean of the steps after the first")
    print("| axis | value | parameters | s/step | generate | score | backward | step "
          "| gen tok/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for axis in args.axes.split(","):
        for value in AXES[axis]:
            point = {**DEFAULTS, axis: value}
            row = step_time.measure(
                args.method, args.steps, "auto", 0, params=params,
                max_new_tokens=point["max new tokens"],
                samples_per_prompt=point["samples per prompt"],
                load=model_loader(point["model"]))
            results.setdefault(axis, []).append((value, row))
            print(format_row(axis, value, row), flush=True)
    if args.plot:
        plot(results, args.plot, args.method)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def format_row(axis: str, value: Any, row: dict) -> str:
    n = len(row["per_step"])
    phases = " | ".join(f"{row['wall_time'].get(p, 0.0) / n:.2f}"
                        for p in ("generate", "score", "backward", "step"))
    return (f"| {axis} | {value} | {row['parameters'] / 1e6:.1f}M | "
            f"{row['seconds_per_step']:.2f} | {phases} | "
            f"{row['generated_tokens_per_step']:.0f} |")


def plot(results: dict[str, list[tuple[Any, dict]]], path: Path, method: str) -> None:
    """One panel per axis: seconds per step against the axis value (model size as parameters,
    log scale); deterministic SVG (no date, fixed ids)."""
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "clbench"
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, (axis, points) in zip(axes[0], results.items()):
        xs = [row["parameters"] / 1e6 if axis == "model" else value for value, row in points]
        ys = [row["seconds_per_step"] for _, row in points]
        ax.plot(xs, ys, marker="o")
        ax.set_xlabel("parameters (millions)" if axis == "model" else axis)
        ax.set_ylabel("seconds per step")
        if axis == "model":
            ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{method}: one training step, 4 prompts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
