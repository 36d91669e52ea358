"""The batch-size finder: finds a planted memory limit in O(log) probes; one real probe in a fresh process;
`--training.local_batch_size auto` resolved by probing (one process), by the estimate (several) or refused (CPU)."""

import logging
import math

import pytest

from tests.conftest import ROOT, run_train
from torchtitan.config_manager import ConfigError, parse_args
from torchtitan.tools.batch_size_finder import (
    ESTIMATE_HEADROOM,
    Probe,
    ProbeFailed,
    benchmark_probe,
    find_max_batch_size,
    find_max_local_batch_size,
    largest_divisor_at_most,
    resolve_local_batch_size,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_estimate import estimate_from_job_config
from torchtitan.tools.runs import ran_out_of_memory

DEBUG = str(ROOT / "train_configs/debug_model.toml")
GIB = 1024**3


def planted(limit: int, calls: list[int]):
    """A fake run that 'runs out of memory' above `limit`."""

    def probe(batch: int) -> Probe:
        calls.append(batch)
        return Probe(batch, "ok" if batch <= limit else "OOM", peak_memory_gib=batch / 10)

    return probe


def never(batch: int) -> Probe:
    raise AssertionError(f"probed batch {batch}")


@pytest.mark.parametrize("start", [1, 16, 37, 40, 64, 500, 10_000])
def test_finds_the_planted_limit_in_log_probes(start):
    calls = []
    best, history = find_max_batch_size(planted(37, calls), start, limit=4096)
    assert best == 37
    assert [p.batch for p in history] == calls and len(set(calls)) == len(calls)  # no batch probed twice
    assert len(calls) <= 2 * math.ceil(math.log2(max(start, 37))) + 2


@pytest.mark.parametrize("limit", [0, 1, 2, 100, 4096])
def test_edges(limit):
    best, history = find_max_batch_size(planted(limit, []), 32, limit=4096)
    assert best == limit
    assert len(history) <= 2 * 12 + 2


def memory_of(fixed: float, per_sample: float, usable: float, calls: list[int]):
    """A fake run whose active peak is fixed + per_sample x batch GiB, 'out of memory' past `usable` GiB; its reserve
    fills the card (139.8 GiB) whatever the batch, as the allocator's does."""

    def probe(batch: int) -> Probe:
        calls.append(batch)
        active = fixed + per_sample * batch
        ok = active <= usable
        return Probe(batch, "ok" if ok else "OOM", active if ok else None, reserved_gib=138.1 if ok else None)

    return probe


@pytest.mark.parametrize("slope_error, most", [(1.0, 3), (1.18, 4), (0.8, 6)])
def test_measured_memory_steers_the_search_to_few_probes(slope_error, most):
    """The 7B's case (2026-11-28, 4 H200s): the first probe, at the estimate's 214, ran with 120.9 GiB active, and
    227 ran two steps with 125.8 (0.90 of the card) where 236 ran out. With the line through the
    measured active peaks (while one probe has run, the estimate's slope: 18% too steep for the 7B) the search
    takes 3-6 probes where doubling and bisection take 9 of minutes each, and finds the same exact answer; a
    guide that is wildly wrong costs at most its few probes."""
    from torchtitan.tools.batch_size_finder import GUIDED_PROBES, predicted_max_batch

    fixed, per_sample, usable = 40.2, 0.377, 0.9 * 139.8  # 227 is the answer (125.78 GiB); 228 needs 126.16
    calls, plain_calls, wrong_calls = [], [], []
    guide = lambda probes: predicted_max_batch(probes, usable, per_sample * slope_error)
    best, _ = find_max_batch_size(memory_of(fixed, per_sample, usable, calls), 214, limit=4096, predict=guide)
    plain, _ = find_max_batch_size(memory_of(fixed, per_sample, usable, plain_calls), 214, limit=4096)
    wrong, _ = find_max_batch_size(memory_of(fixed, per_sample, usable, wrong_calls), 214, 4096, predict=lambda p: 1e6)
    assert best == plain == wrong == 227
    assert len(calls) <= most < len(plain_calls) and len(set(calls)) == len(calls)
    assert 228 in calls  # exact: the next batch was seen to run out of memory
    assert len(wrong_calls) <= len(plain_calls) + GUIDED_PROBES

    # Cut off and resumed with what ran: the search goes on from the recorded bracket, probing none of them again.
    known = tuple(memory_of(fixed, per_sample, usable, [])(b) for b in (214, 218, 236, 254))
    resumed_calls = []
    best, history = find_max_batch_size(memory_of(fixed, per_sample, usable, resumed_calls), 214, 4096, predict=guide,
                                        known=known)  # fmt: skip
    assert best == 227 and not {214, 218, 236, 254} & set(resumed_calls) and len(resumed_calls) <= 3
    assert [p.batch for p in history[:4]] == [214, 218, 236, 254]


def test_multiple_of_and_upper_limit():
    best, _ = find_max_batch_size(planted(37, []), 8, limit=4096, multiple_of=8)
    assert best == 32
    best, history = find_max_batch_size(planted(10**6, []), 8, limit=100)
    assert best == 100 and max(p.batch for p in history) == 100


def test_a_failure_that_is_not_oom_stops_the_search():
    def broken(batch):
        return Probe(batch, "failed (2)")

    with pytest.raises(ProbeFailed, match="batch 16"):
        find_max_batch_size(broken, 16)


def test_start_comes_from_the_estimate():
    calls = []
    result = find_max_local_batch_size(DEBUG, [], memory_gib=0.1, probe=planted(37, calls))
    # The debug model's estimate allows a few hundred images in 0.1 GiB; the probes then bisect down to 37.
    assert result["start"] > 37 and calls[0] == result["start"]
    assert result["batch"] == 37 and result["peak_memory_gib"] == pytest.approx(3.7)
    assert [p["batch"] for p in result["probes"]] == calls


def test_script_keeps_its_names():
    import scripts.find_max_batch_size as script

    assert script.find_max_batch_size is find_max_batch_size
    assert script.find_max_local_batch_size is find_max_local_batch_size


def test_real_probe_runs_in_a_fresh_process_at_a_concrete_batch(tmp_path):
    # The config says "auto": the probe's batch replaces it (on CPU, "auto" would be refused, so a probe
    # that searched again would fail).
    config = tmp_path / "auto.toml"
    config.write_text(ROOT.joinpath("train_configs/debug_model.toml").read_text().replace(
        "local_batch_size = 64", "local_batch_size = 'auto'"))  # fmt: skip
    assert parse_args(["--job.config_file", str(config)]).training.local_batch_size == "auto"
    args = ["--training.ema_decay", "0", "--job.dump_folder", str(tmp_path)]
    outcome = benchmark_probe(str(config), args, steps=1)(4)
    assert outcome.ok, outcome.status
    assert outcome.result["global_batch"] == 4


def auto_config(*args: str):
    return parse_args(["--job.config_file", DEBUG, "--training.local_batch_size", "auto", *args])


def test_largest_divisor_at_most():
    assert [largest_divisor_at_most(48, b) for b in (1, 5, 7, 23, 24, 37, 48, 100)] == [1, 4, 6, 16, 24, 24, 48, 48]
    assert largest_divisor_at_most(13, 12) == 1


def test_auto_on_one_gpu_probes_from_the_estimate():
    calls = []
    batch = resolve_local_batch_size(auto_config(), 1, 1, "cuda", memory_bytes=GIB // 10, probe=planted(37, calls))
    assert batch == 37
    assert calls[0] > 37 and len(calls) <= 2 * math.ceil(math.log2(calls[0])) + 2


def test_auto_with_a_global_batch_divides_it(caplog):
    cfg = auto_config("--training.global_batch_size", "96")
    calls = []
    logger.addHandler(caplog.handler)  # the project logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.INFO, logger.name):
            batch = resolve_local_batch_size(cfg, 1, 2, "cuda", memory_bytes=GIB // 10, probe=planted(37, calls))
    finally:
        logger.removeHandler(caplog.handler)
    # 96 / 2 ranks = 48 images per rank per step; 37 fit, the largest divisor of 48 not above it is 24.
    assert batch == 24 and max(calls) <= 48
    assert "37 fits" in caplog.text and "using 24" in caplog.text and "2 accumulation steps" in caplog.text
    assert cfg.training.local_batch_size == "auto"  # the caller stores the answer


def test_auto_under_torchrun_takes_the_estimate_without_probing():
    cfg, memory = auto_config("--training.ema_decay", "0"), 2 * GIB
    batch = resolve_local_batch_size(cfg, 4, 4, "cuda", memory_bytes=memory, probe=never)

    def peak(b: int) -> int:
        cfg.training.local_batch_size = b
        return estimate_from_job_config(cfg, 4).peak

    assert batch > 1 and peak(batch) <= ESTIMATE_HEADROOM * memory < peak(batch + 1)


def test_auto_fails_clearly():
    from torchtitan.config_validation import validate_layout

    with pytest.raises(ConfigError, match=r"training.local_batch_size = 'auto' in the command line.*CUDA"):
        validate_layout(auto_config(), 1, "cpu")
    with pytest.raises(ConfigError, match="not even a batch of 1"):
        resolve_local_batch_size(auto_config(), 1, 1, "cuda", memory_bytes=GIB, probe=planted(0, []))
    with pytest.raises(ConfigError, match="training.global_batch_size = 30 .*data-parallel degree 4"):
        validate_layout(auto_config("--training.global_batch_size", "30"), 4, "cuda")
    assert resolve_local_batch_size(parse_args(["--training.local_batch_size", "5"]), 1, 1, "cpu", probe=never) == 5


def test_trainer_refuses_auto_on_cpu(tmp_path):
    result = run_train(["--job.config_file", DEBUG, "--training.local_batch_size", "auto", "--job.dump_folder",
                        str(tmp_path)], check=False)  # fmt: skip
    assert result.returncode == 2
    assert "training.local_batch_size = 'auto'" in result.stderr and "CUDA" in result.stderr


def test_only_device_memory_errors_count_as_out_of_memory():
    # torch's error, and the line Inductor's autotuning logs (and survives) when a Triton GEMM config needs more
    # shared memory than the GPU has: the second must not pass for a memory limit (it did, on an H100, 2026-11-25).
    torch_oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
    triton = ("RuntimeError: No valid triton configs. OutOfMemoryError: out of resource: triton_mm Required: 262144 "
              "Hardware limit:232448 Reducing block sizes or `num_stages` may help.")  # fmt: skip
    assert ran_out_of_memory(torch_oom) and ran_out_of_memory(triton + "\n" + torch_oom)
    assert not ran_out_of_memory(triton) and not ran_out_of_memory("RuntimeError: check_memory_pool")
    # cuBLAS creating a handle for the backward thread with the device full (the memory lab's fp32 probe at 132).
    cublas = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    assert ran_out_of_memory(cublas) and not ran_out_of_memory("RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED")
