"""Download + checksum throughput on the 757 MB route checkpoint, against `cp` + `sha256sum`.

Ours is the code a job runs for these two stages, without the database rows: the download
stage (hard links into its work folder), the artifact store's puts of its outputs (a copy
the kernel makes while a second thread hashes what landed, files in parallel, fsync'd),
then the checksum stage verifying against SHA256SUMS with the store's witness, so the
bytes are not read a second time. "Ours, checksum elsewhere" is the distributed case where
checksum runs in another process: it re-hashes, files in parallel.

The reference copies the same files with ``cp`` and hashes the copies with ``sha256sum``
(one file per ``sha256sum`` call list, as a shell script would). Neither side's source is
cold: the checkpoint was just written. Ours fsyncs what it stores; ``cp`` does not.

    .venv/bin/python bench/io.py [--runs 3] [--workdir DIR]

Last line: ``io: ours_s=… ours_gb_per_s=… reference_s=… reference_gb_per_s=… ratio=…`` (medians;
ratio = reference time / ours). Target: ours ≥ 1 GB/s. CPU seconds of every thread are printed
too: on a busy machine they tell what the wall time would be on idle cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def ours(ckpt: Path, root: Path, *, witness: bool) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) of download.run + the store's puts + checksum.run."""
    from pipeline.artifacts import LocalStore
    from pipeline.artifacts.store import put_all
    from pipeline.stages import checksum, download
    from pipeline.stages.base import NO_CLIENTS, InputFile, JobSpec

    store = LocalStore(root / "store")
    (root / "download").mkdir()
    (root / "checksum").mkdir()
    os.sync()
    cpu_started = _cpu_s(resource.RUSAGE_SELF)
    started = time.perf_counter()
    result = download.run(download.make_params(JobSpec(str(ckpt))), {}, root / "download")
    stored = put_all(store, [(out.path, out.sha256) for out in result.outputs])
    inputs = {f"download/{out.name}": InputFile(out.name, store.path(s.sha256), s.sha256, s.size_bytes)
              for out, s in zip(result.outputs, stored, strict=True)}
    # The stage's clients, as execution hands them over (the witness only where the store is local).
    clients = replace(NO_CLIENTS, store_witness=store) if witness else NO_CLIENTS
    verified = checksum.run(checksum.make_params(JobSpec(str(ckpt))), inputs, root / "checksum", clients)
    seconds = time.perf_counter() - started
    cpu_s = _cpu_s(resource.RUSAGE_SELF) - cpu_started
    if verified.metrics["verified_against"] != ["SHA256SUMS"]:
        raise SystemExit(f"checksum did not verify against SHA256SUMS: {verified.metrics}")
    return seconds, cpu_s


def reference(ckpt: Path, root: Path) -> tuple[float, float, float]:
    """Seconds of `cp -r` of the folder, then of `sha256sum` over the copies; CPU seconds of both."""
    os.sync()
    cpu_started = _cpu_s(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(ckpt), str(root / "copy")], check=True)
    copied = time.perf_counter()
    files = sorted(str(p) for p in (root / "copy").iterdir())
    subprocess.run(["sha256sum", *files], check=True, capture_output=True)
    return copied - started, time.perf_counter() - copied, _cpu_s(resource.RUSAGE_CHILDREN) - cpu_started


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    from bench.route import SMOKE_SHAPE, build_checkpoint

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1
    load_before = os.getloadavg()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # a folder not made yet is made
    root = Path(tempfile.mkdtemp(prefix="bench-io-", dir=args.workdir))
    times: dict[str, list[float]] = {"ours": [], "elsewhere": [], "cp": [], "sha256sum": []}
    cpu: dict[str, list[float]] = {"ours": [], "elsewhere": [], "reference": []}
    try:
        ckpt, _ = build_checkpoint(root / "ckpt", SMOKE_SHAPE if args.smoke else None)
        size_bytes = sum(p.stat().st_size for p in ckpt.iterdir())
        n_files = len(list(ckpt.iterdir()))
        for index in range(args.runs):
            for key, witness in (("ours", True), ("elsewhere", False)):
                work = root / f"{key}{index}"
                wall_s, cpu_s = ours(ckpt, work, witness=witness)
                times[key].append(wall_s)
                cpu[key].append(cpu_s)
                shutil.rmtree(work)
            work = root / f"ref{index}"
            work.mkdir()
            cp_s, sha_s, ref_cpu_s = reference(ckpt, work)
            times["cp"].append(cp_s)
            times["sha256sum"].append(sha_s)
            cpu["reference"].append(ref_cpu_s)
            shutil.rmtree(work)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = [c + s for c, s in zip(times["cp"], times["sha256sum"], strict=True)]
    gb = size_bytes / 1e9
    print(f"checkpoint: {size_bytes / 1e6:.0f} MB in {n_files} files; {args.runs} runs of each side")
    print(f"ours, download + store + checksum     {_spread(times['ours'])}")
    print(f"ours, checksum in another process     {_spread(times['elsewhere'])}")
    print(f"cp -r                                 {_spread(times['cp'])}")
    print(f"sha256sum of the copies               {_spread(times['sha256sum'])}")
    print(f"reference, cp + sha256sum             {_spread(ref)}")
    median_cpu = {key: statistics.median(values) for key, values in cpu.items()}
    print(f"CPU seconds of every thread (medians): ours {median_cpu['ours']:.2f}, checksum elsewhere "
          f"{median_cpu['elsewhere']:.2f}, reference {median_cpu['reference']:.2f}; on idle cores the "
          f"wall time cannot go below CPU seconds / {os.cpu_count()}")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores")
    ours_s, ref_s = statistics.median(times["ours"]), statistics.median(ref)
    print(f"io: ours_s={ours_s:.3f} ours_gb_per_s={gb / ours_s:.2f} "
          f"elsewhere_gb_per_s={gb / statistics.median(times['elsewhere']):.2f} "
          f"reference_s={ref_s:.3f} reference_gb_per_s={gb / ref_s:.2f} ratio={ref_s / ours_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
