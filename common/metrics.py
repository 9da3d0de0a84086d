"""Run metrics: metrics.jsonl, TensorBoard events, a rank-0 progress bar, and a loss-curve PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from common.distributed import DistInfo


def rewind_jsonl(path: Path, last_step: int) -> None:
    """Drop records past `last_step` (logged by a run that died after its last checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class MetricsLogger:
    """Rank 0 writes; other ranks' calls are no-ops, so callers need no rank checks."""

    def __init__(self, run_dir: str | Path, dist: DistInfo, *, max_steps: int, start_step: int, progress_bar: bool):
        self.enabled = dist.is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.png = Path(run_dir) / "loss.png"
        self._tb = self._bar = None
        if not self.enabled:
            return
        rewind_jsonl(self.path, start_step)
        self._file = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
        if progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}", refresh=False)
        else:
            print(
                " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()), flush=True
            )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._file.close()
        plot_loss_curve(self.path, self.png)


def add_to_step(path: Path, step: int, values: dict[str, Any]) -> None:
    """Values taken after the loop's logger closed (or before it opened), e.g. an evaluation: merged into the record of
    ``step`` when it is the file's last one, else appended as a record of their own, so that no step is logged twice."""
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    last = json.loads(lines[-1]) if lines else None
    if last is not None and last["step"] == step:
        lines[-1] = json.dumps(last | values)
    else:
        lines.append(json.dumps({"step": step, **values}))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, png_path: Path) -> None:
    records = [r for r in read_metrics(metrics_path) if "loss" in r] if metrics_path.exists() else []
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [r["loss"] for r in records], label="loss", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if "lr" in records[0]:
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [r["lr"] for r in records], color="tab:orange", alpha=0.6, label="lr")
        lr_ax.set_ylabel("lr", color="tab:orange")
    ax.set_title(f"training loss ({png_path.parent.name})")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def plot_reward_curve(metrics_path: Path, png_path: Path) -> None:
    """GRPO's reward curve: the training reward per step (``reward``: the mean over the step's samples) and the
    held-out reward (``eval/reward``: greedy answers to the val prompts, where it was taken) against the step."""
    records = read_metrics(metrics_path) if metrics_path.exists() else []
    train = [(r["step"], r["reward"]) for r in records if "reward" in r and "loss" in r]
    held_out = [(r["step"], r["eval/reward"]) for r in records if "eval/reward" in r]
    if not train and not held_out:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="reward (training samples)", color="tab:blue", alpha=0.8)
    if held_out:
        ax.plot(*zip(*held_out), "o", label="eval/reward (held-out, greedy)", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"GRPO reward ({png_path.parent.name})")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
