"""Metrics sinks: a failing TensorBoard or wandb write is an error in the log, never the end of a run; the DP
console line."""

import json

from torchtitan.components.metrics import MetricsLogger
from torchtitan.config_manager import JobConfig


class Broken:
    def __init__(self):
        self.calls = 0

    def add_scalar(self, *args):
        self.calls += 1
        raise OSError("No space left on device")

    def log(self, *args, **kwargs):
        self.calls += 1
        raise ConnectionError("wandb's service went away")

    def close(self):
        pass

    finish = close


def test_a_failing_sink_is_logged_and_left_off(tmp_path, caplog):
    logger = MetricsLogger(JobConfig(), tmp_path, rank=0)
    logger.tb, logger.wandb = Broken(), Broken()
    tb, wandb = logger.tb, logger.wandb
    record = {"loss": 1.0, "grad_norm": 2.0, "lr": 1e-3, "images_per_second": 5.0, "step_time_s": 0.1,
              "data_time_s": 0.0}  # fmt: skip
    for step in (1, 2, 3):
        logger.log(step, record)
    logger.close()
    assert (tb.calls, wandb.calls) == (1, 1)  # each failed once, then was left off
    assert logger.tb is None and logger.wandb is None
    assert "metrics: writing to TensorBoard failed (OSError: No space left on device)" in caplog.text
    assert "metrics: writing to wandb failed (ConnectionError" in caplog.text
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # metrics.jsonl kept every step


def test_under_dp_the_console_line_names_the_noised_norm_and_shows_the_per_sample_norms(tmp_path, caplog):
    logger = MetricsLogger(JobConfig(), tmp_path, rank=0)
    logger.color = False
    record = {"loss": 1.0, "dp_noised_grad_norm": 2.5, "lr": 1e-3, "images_per_second": 5.0, "step_time_s": 0.1,
              "data_time_s": 0.0, "dp_epsilon": 0.5, "dp_grad_norm_mean": 0.8, "dp_grad_norm_p95": 1.9,
              "dp_clipped_fraction": 0.25}  # fmt: skip
    with caplog.at_level("INFO"):
        logger.log(1, record)
    logger.close()
    line = caplog.records[-1].getMessage()
    assert "  noised_grad_norm 2.500  " in line and "  grad_norm" not in line
    assert line.endswith("eps 0.500  sample_norm mean 0.800 p95 1.900 clipped 25.0%")
    logged = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [{"step": 1, **record}]


def test_a_resumed_run_drops_the_records_an_earlier_run_logged_after_its_step(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": step, "loss": 1.0 / step}) for step in range(1, 7)]
    path.write_text("\n".join(records) + '\n{"step": 7, "lo')  # killed at step 7, mid-line
    MetricsLogger(JobConfig(), tmp_path, rank=0).close()  # no start step: the file is kept as it is
    assert path.read_text().endswith('{"step": 7, "lo')
    with caplog.at_level("INFO"):
        logger = MetricsLogger(JobConfig(), tmp_path, rank=0, start_step=4)  # resumed from the step-4 checkpoint
    assert f"metrics: dropped 3 record(s) after step 4 from {path}" in caplog.text
    logger.log(5, {"loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "images_per_second": 5.0, "step_time_s": 0.1,
                   "data_time_s": 0.0})  # fmt: skip
    logger.close()
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5] and logged[3] == {"step": 4, "loss": 0.25}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # rewritten in place, no leftover
    # A run from step 0 (no checkpoint to resume) keeps the earlier run's records, moved aside, not deleted.
    before = path.read_text()
    MetricsLogger(JobConfig(), tmp_path, rank=0, start_step=0).close()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.before-")]
    assert len(aside) == 1 and aside[0].read_text() == before and path.read_text() == ""


def _strict(line: str) -> dict:
    """json.loads that refuses Python's NaN / Infinity extension: what any other JSON reader refuses."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_an_empty_step_is_logged_as_empty_and_metrics_jsonl_is_strict_json(tmp_path, caplog):
    """A Poisson step that drew no sample has no loss: null in metrics.jsonl (it was a bare NaN, not JSON, that read
    as divergence), and the console line says the step was empty; the DP window's count of empty steps is shown. A
    non-finite value (epsilon at sigma 0 is inf) is null in metrics.jsonl too, as it is shown on the console."""
    logger = MetricsLogger(JobConfig(), tmp_path, rank=0)
    logger.color = False
    record = {"loss": None, "dp_noised_grad_norm": 2.5, "lr": 1e-3, "images_per_second": 5.0, "step_time_s": 0.1,
              "data_time_s": 0.0, "dp_epsilon": float("inf"), "dp_empty_steps": 2}  # fmt: skip
    with caplog.at_level("INFO"):
        logger.log(4, record)
        logger.log(5, {**record, "loss": 0.5, "dp_epsilon": 1.5, "dp_empty_steps": 0})
    logger.close()
    empty, full = (r.getMessage() for r in caplog.records[-2:])
    assert empty.startswith("step      4  empty step: drew no sample, no loss  noised_grad_norm 2.500  ")
    assert empty.endswith("  eps inf  empty steps 2")
    assert full.startswith("step      5  loss 0.5000  ") and full.endswith("  eps 1.500")  # no empty step to count
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line) for line in lines] == [
        {"step": 4, **record, "dp_epsilon": None},
        {"step": 5, **record, "loss": 0.5, "dp_epsilon": 1.5, "dp_empty_steps": 0},
    ]
