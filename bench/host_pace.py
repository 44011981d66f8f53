"""Does the train job's pace follow the host? Reads the host.log that bench/smollm2_campaign.sh
writes during a build (every 10 s: the clock, /proc/stat's cpu line, the load, each GPU's SM
clock, power and use, training's latest progress line) and prints, per new progress line, its
ms a step beside the CPU time stolen by the hypervisor, the CPU busy and the GPU's SM clock
over the same interval, then the correlation of the pace with each.

A SmolLM2-sized draft's step is set by the host launching its kernels (BENCHMARKS.md, "Muon
batched by matrix shape"), and its pace drifted within builds by 40-77 ms a step with no cause
found; stolen time (other guests of the machine's host) is one candidate this shows or rules out.

    python3 bench/host_pace.py /tmp/campaign/host.log
"""

import argparse
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

PACE = re.compile(r"step (\d+)/\d+ \(epoch (\d+)/\d+\).*; ([\d,.]+) ms a step since the last line")
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest time is in user)
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class Sample:
    clock: float
    cpu: dict[str, int]
    sm_mhz: float | None
    train: str


def parse_line(line: str) -> Sample:
    parts = [part.strip() for part in line.split(" | ", 3)]
    words = parts[0].split()
    if len(parts) != 4 or len(words) < 2 + len(FIELDS) or words[1] != "cpu":
        raise ValueError(
            f"not a host.log line (clock and /proc/stat's cpu line | load | GPUs | progress "
            f"line): {line[:80]!r}"
        )
    _load, gpus, train = parts[1:]
    cpu = dict(zip(FIELDS, map(int, words[2 : 2 + len(FIELDS)]), strict=True))
    first_gpu = gpus.split(";")[0].strip()
    sm_mhz = float(first_gpu.split(",")[0]) if first_gpu else None
    return Sample(float(words[0]), cpu, sm_mhz, train)


def intervals(samples: list[Sample]) -> list[dict]:
    """One row per sample whose progress line is new: the pace it reports and the host over
    the interval since the previous sample (the line's pace spans about that interval)."""
    rows = []
    for before, now in zip(samples, samples[1:], strict=False):
        match = PACE.search(now.train)
        if not match or now.train == before.train:
            continue
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
                "sm_mhz": now.sm_mhz,
            }
        )
    return rows


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("host_log", type=Path)
    p.add_argument(
        "--max-ms", type=float, default=500.0, help="leave out lines spanning a validation pass"
    )
    a = p.parse_args()
    lines = a.host_log.read_text().splitlines()
    samples = []
    for number, line in enumerate(lines, 1):
        try:
            samples.append(parse_line(line))
        except ValueError as exc:
            raise SystemExit(f"error: {a.host_log} line {number}: {exc}") from None
    rows = [r for r in intervals(samples) if r["ms_per_step"] <= a.max_ms]
    if not rows:
        raise SystemExit(f"error: {a.host_log} has no training progress lines to compare")
    print("seconds  epoch  step    ms/step  steal  busy   SM MHz")
    for r in rows:
        print(
            f"{r['seconds']:7.0f}  {r['epoch']:5d}  {r['step']:6d}  {r['ms_per_step']:7.1f}  "
            f"{r['steal']:5.3f}  {r['busy']:5.3f}  {r['sm_mhz'] or float('nan'):6.0f}"
        )
    pace = [r["ms_per_step"] for r in rows]
    print(f"host_pace.lines = {len(rows)}")
    print(f"host_pace.ms_per_step.range = {min(pace):.1f}-{max(pace):.1f}")
    for key in ("steal", "busy", "sm_mhz"):
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
