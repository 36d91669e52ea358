"""scripts/plot_scaling.py: the scaling table against one GPU, from benchmark.py's JSON rows, and its plot."""

import json

import pytest
from PIL import Image

from scripts.plot_scaling import main, scaling_table


def row(name, gpus, global_batch, images_per_second, layout, status="ok"):
    return {"name": name, "world_size": gpus, "global_batch": global_batch, "images_per_second": images_per_second,
            "layout": layout, "status": status}  # fmt: skip


ROWS = [
    row("one_32", 1, 32, 500.0, "single"),
    row("two_32", 2, 64, 900.0, "ddp"),
    row("four_32", 4, 128, 1600.0, "ddp"),
    row("four_32_fsdp", 4, 128, 1000.0, "fsdp"),
    row("four_64", 4, 256, 2000.0, "ddp"),  # no one-GPU row at 64: no scaling figure
    row("four_224", 4, 896, 0.0, "ddp", status="timeout"),
]


def test_scaling_is_images_per_second_over_gpus_times_one_gpu():
    table = {e["name"]: e for e in scaling_table(ROWS)}
    assert table["one_32"]["scaling"] == pytest.approx(1.0)
    assert table["two_32"]["scaling"] == pytest.approx(900 / (2 * 500))
    assert table["four_32"]["scaling"] == pytest.approx(1600 / (4 * 500))
    assert table["four_32_fsdp"]["scaling"] == pytest.approx(1000 / (4 * 500))
    assert table["four_64"]["scaling"] is None and table["four_64"]["batch_per_gpu"] == 64
    assert "four_224" not in table  # unfinished rows are listed, not tabled


def test_cli_writes_table_plot_and_refuses_rows_without_world_size(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ROWS))
    out, table = tmp_path / "scaling.png", tmp_path / "table.json"
    main([str(rows), "--out", str(out), "--json-out", str(table)])
    printed = capsys.readouterr().out
    assert "| two_32 | 2 | 32 | ddp | 900.0 | 90.0% |" in printed and "four_224 (timeout)" in printed
    assert Image.open(out).size[0] > 0 and len(json.loads(table.read_text())) == 5
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"name": "x", "global_batch": 32, "images_per_second": 1.0}]))
    with pytest.raises(SystemExit, match=r"error: rows \['x'\] have no world_size"):
        main([str(old), "--out", str(out)])
