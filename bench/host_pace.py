"""Does the train job's pace follow the host? Reads the host.log that bench/smollm2_campaign.sh
writes during a build (every 2 s: the clock, /proc/stat's cpu line, the load, each GPU's SM
clock, power and use, training's latest progress line) and prints, per new progress line, its
ms a step beside the CPU time stolen by the hypervisor, the CPU busy and the GPU's SM clock,
power and use (the mean of the samples in the span) over the span that pace covers, then the
correlation of the pace with each. A GPU busy well below 100 % while training waits on no
batch means the host sets the pace (launching kernels), not the GPU.

A SmolLM2-sized draft's step is set by the host launching its kernels (BENCHMARKS.md, "Muon
batched by matrix shape"), and its pace drifts within and between builds. On the ffd build's log
(BENCHMARKS.md, "ffd packing as the default") the pace went with the GPU idling and with time
stolen by the hypervisor (other guests of the machine's host).

    python3 bench/host_pace.py /tmp/campaign/host.log
"""

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

PACE = re.compile(r"step (\d+)/\d+ \(epoch (\d+)/\d+\).*; ([\d,.]+) ms a step since the last line")
EPOCH = re.compile(r"\(epoch (\d+)/\d+\)")
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest time is in user)
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class Sample:
    clock: float
    cpu: dict[str, int]
    gpus: tuple[tuple[float | None, ...], ...]  # per GPU (SM MHz, W, % busy); None: no number
    train: str


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", or "No devices were found" (nvidia-smi writes it to stdout)
        return None


def parse_line(line: str) -> Sample:
    parts = [part.strip() for part in line.split(" | ", 3)]
    words = parts[0].split()
    try:
        if len(parts) != 4 or len(words) < 2 + len(FIELDS) or words[1] != "cpu":
            raise ValueError
        clock = float(words[0])
        cpu = dict(zip(FIELDS, map(int, words[2 : 2 + len(FIELDS)]), strict=True))
    except ValueError:
        raise ValueError(
            f"not a host.log line (clock and /proc/stat's cpu line | load | GPUs | progress "
            f"line): {line[:80]!r}"
        ) from None
    gpus = tuple(
        tuple((*map(number, g.split(",")), None, None, None)[:3])
        for g in parts[2].split(";")
        if g.strip()
    )
    return Sample(clock, cpu, gpus, parts[3])


GPU_KEYS = ("sm_mhz", "gpu_watts", "gpu_busy")


def gpu_means(span: list[Sample], gpu: int) -> dict[str, float | None]:
    """Each GPU reading's mean over the samples of a span that have it (None if none do)."""
    means = {}
    for k, key in enumerate(GPU_KEYS):
        values = [s.gpus[gpu][k] for s in span if gpu < len(s.gpus)]
        values = [v for v in values if v is not None]
        means[key] = statistics.fmean(values) if values else None
    return means


def intervals(samples: list[Sample], gpu: int = 0) -> list[dict]:
    """One row per progress line with a pace: that pace beside the host between the first
    sample that showed the line before it and the first that showed it, the span the pace
    covers (to within a sampling interval at each end). A line whose span crosses an epoch's
    end (a validation pass) is left out."""
    rows, before, span = [], None, []  # the first sample of the previous progress line
    for now in samples:
        span.append(now)  # the samples after ``before``, up to ``now``
        if not now.train or (before is not None and now.train == before.train):
            continue  # no line yet (or the log unread), or the same line as before
        match, epoch = PACE.search(now.train), EPOCH.search(now.train)
        if before is not None and match and epoch:
            last = EPOCH.search(before.train)
            if last and last[1] == epoch[1]:
                delta = {k: now.cpu[k] - before.cpu[k] for k in FIELDS}
                total = sum(delta.values()) or 1
                busy = sum(delta[k] for k in ("user", "nice", "system", "irq", "softirq"))
                rows.append(
                    {
                        "seconds": now.clock - samples[0].clock,
                        "step": int(match[1]),
                        "epoch": int(match[2]),
                        "ms_per_step": float(match[3].replace(",", "")),
                        "steal": delta["steal"] / total,
                        "busy": busy / total,
                        **gpu_means(span, gpu),
                    }
                )
        before, span = now, []
    return rows


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def read_samples(path: Path) -> list[Sample]:
    """The log's samples; a damaged last line (a log archived while a line was written) is
    left out with a warning, any other damaged line is an error."""
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: {path}: {exc}") from None
    samples = []
    for index, line in enumerate(lines, 1):
        try:
            samples.append(parse_line(line))
        except ValueError as exc:
            if index == len(lines):
                print(f"warning: {path} line {index} left out: {exc}", file=sys.stderr)
                break
            raise SystemExit(f"error: {path} line {index}: {exc}") from None
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("host_log", type=Path)
    p.add_argument("--gpu", type=int, default=0, help="the GPU whose readings are shown")
    p.add_argument(
        "--max-ms", type=float, default=500.0, help="leave out lines slower than this (a stall)"
    )
    a = p.parse_args()
    rows = [r for r in intervals(read_samples(a.host_log), a.gpu) if r["ms_per_step"] <= a.max_ms]
    if not rows:
        raise SystemExit(f"error: {a.host_log} has no training progress lines to compare")
    print("seconds  epoch  step    ms/step  steal  busy   SM MHz  GPU W  GPU %")
    for r in rows:
        gpu = ("-" if r[k] is None else f"{r[k]:.0f}" for k in GPU_KEYS)
        print(
            f"{r['seconds']:7.0f}  {r['epoch']:5d}  {r['step']:6d}  {r['ms_per_step']:7.1f}  "
            f"{r['steal']:5.3f}  {r['busy']:5.3f}  " + "  ".join(f"{g:>5s}" for g in gpu)
        )
    pace = [r["ms_per_step"] for r in rows]
    print(f"host_pace.lines = {len(rows)}")
    print(f"host_pace.ms_per_step.range = {min(pace):.1f}-{max(pace):.1f}")
    for key in ("steal", "busy", *GPU_KEYS):
        pairs = [(r["ms_per_step"], r[key]) for r in rows if r[key] is not None]
        if not pairs:
            continue
        values = [v for _, v in pairs]
        r = correlation([ms for ms, _ in pairs], values)
        print(f"host_pace.{key}.range = {min(values):.3f}-{max(values):.3f}")
        shown = "n/a" if r is None else f"{r:+.2f}"
        print(f"host_pace.{key}.correlation_with_ms_per_step = {shown}")


if __name__ == "__main__":
    main()
