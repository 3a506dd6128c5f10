"""bench/lab/rejoins.py: the re-joins of a device, read from its round records."""

from __future__ import annotations

import json

from bench.lab import rejoins


def test_a_rejoin_is_read_with_the_rounds_before_it(tmp_path) -> None:
    recs = [{"round": 1, "train_loss": 1.0, "global_accuracy": 0.5, "diverged": 0},
            {"round": 2, "train_loss": 80.0, "global_accuracy": 0.2, "diverged": 0, "cold_excluded": ["b"]},
            {"round": 3, "train_loss": 700.0, "global_accuracy": 0.1, "diverged": 0},
            {"round": 4, "train_loss": None, "global_accuracy": 0.8, "diverged": 1, "cold_start": "diverged",
             "neighbour_ids": ["b", "c"], "neighbours": 2},
            {"round": 5, "train_loss": 0.1, "global_accuracy": 0.9, "diverged": 1, "neighbours": 2}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    info = rejoins.device_rejoins(path)
    assert info["rounds"] == 5 and info["diverged"] == 1 and info["excluded_by_it"] == ["b"]
    assert info["rejoins"] == [{"round": 4, "loss_before": [80.0, 700.0], "accuracy_before": 0.1,
                                "accuracy_after": 0.8, "adopted_from": ["b", "c"]}]
    assert (info["last_round"], info["last_accuracy"], info["last_neighbours"]) == (5, 0.9, 2)


def test_a_folder_without_devices_is_refused(tmp_path, capsys) -> None:
    assert rejoins.main([str(tmp_path)]) == 2
    assert "no lab output folder" in capsys.readouterr().err
