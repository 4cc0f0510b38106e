"""`medusa-heads tune`: the fastest candidate under a fake timing source is recorded per machine, dtype and thread
count, and is what `generate` then runs; a missing, corrupted, stale or foreign record falls back to the table."""

import json
from datetime import date

import pytest
import torch

from medusa_heads.backbone import cache_home
from medusa_heads.inference.registry import default_configuration, default_drafter, tune_candidates, tuning_prompts
from medusa_heads.apps.cli import main
from medusa_heads.apps.tune import tune
from medusa_heads.inference.tuned import RECORD_VERSION, record_path

from test_cli import assert_clean_error, run_cli  # noqa: E402  (pytest puts tests/ on sys.path)

CPU = torch.device("cpu")
BF16 = torch.bfloat16


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh MEDUSA_HEADS_HOME, so that the machine's own record is neither read nor written; its backbone cache
    is the real one (linked), so that the embedded model is not converted again."""
    models = cache_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (tmp_path / "models").symlink_to(models)
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path))
    return tmp_path


def faster(index: int, calls: list | None = None):
    """A fake timing source under which candidate `index` answers in 10 ms a token and the others in 12."""
    candidates = tune_candidates(BF16)

    def measure(candidate, prompt):
        if calls is not None:
            calls.append((candidates.index(candidate), prompt))
        return (0.10 if candidates.index(candidate) == index else 0.12), 10
    return measure


def _cpuinfo(family: int) -> str:
    return f"cpu family\t: {family}\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_bf16\n"


def table(dtype: torch.dtype = BF16, batch_size: int = 1):
    drafter, options = default_drafter(dtype, batch_size)
    return default_configuration(dtype, batch_size), drafter, options


def assert_table(dtype: torch.dtype = BF16):
    config, drafter, options = table(dtype)
    assert (config.drafter, config.options, config.heads, config.tuned_on) == (drafter, options, None, None)
    assert "run `medusa-heads tune`" in config.source


@pytest.mark.parametrize("fastest", [0, 1])
def test_tune_records_the_fastest_candidate_and_the_default_follows_it(home, fastest):
    candidates = tune_candidates(BF16)
    assert len(candidates) >= 2 and candidates[0].drafter == default_drafter(BF16)[0] and candidates[0].heads is None
    assert_table()
    calls = []
    prompts = tuning_prompts()[:3]
    record, path = tune(BF16, CPU, prompts, faster(fastest, calls), 16)
    assert path == record_path(BF16, CPU) and path.is_relative_to(home / "profiles")
    assert "bfloat16" in path.name and f"{torch.get_num_threads()}threads" in path.name
    assert json.loads(path.read_text()) == record
    assert record["choice"] == candidates[fastest].settings()
    assert [m["ms_per_token"] for m in record["measured"]] == [10.0 if i == fastest else 12.0
                                                              for i in range(len(candidates))]
    # every candidate answered every prompt, the first to answer rotating from prompt to prompt
    assert sorted(calls) == sorted((i, p) for i in range(len(candidates)) for p in prompts)
    assert [calls[p * len(candidates)][0] for p in range(2)] == [0, 1]

    _, path = tune(BF16, CPU, prompts, faster(fastest, calls := []), 16, seconds=0)  # the first prompt only
    assert len(calls) == len(candidates) and json.loads(path.read_text())["prompts"] == 1

    chosen = default_configuration(BF16)
    assert chosen.settings() == candidates[fastest].settings()
    assert chosen.source == f"tuned on this machine {date.today().isoformat()}"
    # larger batches and other dtypes keep the table
    assert default_configuration(BF16, 2).settings() == table(BF16, 2)[0].settings()
    assert_table(torch.float32)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 1}'])
def test_a_corrupted_record_falls_back_to_the_table_with_one_warning(home, caplog, text):
    tune(BF16, CPU, tuning_prompts()[:2], faster(1), 8)
    path = record_path(BF16, CPU)
    path.write_text(text)
    assert_table()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    assert path.read_text() == text  # left for the user to look at; `tune` replaces it


@pytest.mark.parametrize("change", [{"version": RECORD_VERSION - 1},
                                    {"choice": {"heads": "smollm2-135m-embedded-eagle9"}}])
def test_a_record_of_another_version_or_configuration_falls_back(home, caplog, change):
    _, path = tune(BF16, CPU, tuning_prompts()[:2], faster(1), 8)
    record = json.loads(path.read_text())
    for key, value in change.items():
        record[key] = {**record[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(record))
    assert_table()
    assert "another version of medusa-heads, or names a configuration" in caplog.text


def test_a_record_for_another_cpu_dtype_or_thread_count_is_not_used(home, monkeypatch):
    monkeypatch.setattr("medusa_heads.device._cpuinfo", lambda: _cpuinfo(25))  # a Zen 4
    _, zen4 = tune(BF16, CPU, tuning_prompts()[:2], faster(1), 8)
    assert default_configuration(BF16).tuned_on is not None
    assert_table(torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert_table()
    finally:
        torch.set_num_threads(threads)

    monkeypatch.setattr("medusa_heads.device._cpuinfo", lambda: _cpuinfo(26))  # a Zen 5, named alike
    assert record_path(BF16, CPU) != zen4 and "family-25" in zen4.name
    assert_table()
    zen4.replace(record_path(BF16, CPU))  # even under this machine's name, the record says where it was made
    assert_table()


def test_the_tune_command_prints_the_choice_and_warns_on_a_busy_cpu(home, monkeypatch, capsys, caplog):
    monkeypatch.setattr("medusa_heads.apps.tune.greedy_timer", lambda *args, **kwargs: faster(1))
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    assert main(["tune", "--dtype", "bfloat16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{len(tune_candidates(BF16))} configurations on {len(tuning_prompts())} prompts, "
                               "up to 96 tokens each") and "bfloat16" in lines[0]
    assert lines[1].endswith(f": {tune_candidates(BF16)[0]}") and "1.000x the table's" in lines[1]
    assert lines[2].endswith(f": {tune_candidates(BF16)[1]}  <- chosen") and "10.0 ms a token" in lines[2]
    assert str(record_path(BF16, CPU)) in lines[3]
    assert "The CPU is busy (load average 64.0" in caplog.text


def test_tune_refuses_bad_input(cli):
    assert_clean_error(cli("tune", "--max-new-tokens", "0"), "at least 1")
    assert_clean_error(cli("tune", "--dtype", "float8"), "Unknown dtype")
    assert_clean_error(cli("tune", "--seconds", "0"), "above 0")
    if len(tune_candidates(torch.float32)) == 1:
        assert_clean_error(cli("tune", "--dtype", "float32"), "nothing to tune")


@pytest.mark.slow
def test_generate_runs_the_tuned_configuration_and_says_where_it_came_from(cli, home):
    candidates = tune_candidates(BF16)
    eagle3 = next(c for c in candidates if c.heads)
    tune(BF16, CPU, tuning_prompts()[:2], faster(candidates.index(eagle3)), 8)
    args = ("generate", "--prompt", "Name three colors.", "--max-new-tokens", "8", "--dtype", "bfloat16")
    tuned = cli(*args)
    line = tuned.stderr.strip().splitlines()[-1]
    assert tuned.returncode == 0 and f"drafter {eagle3.drafter} (tree {eagle3.options['tree']})" in line, tuned.stderr
    assert eagle3.heads_path in line and f"{eagle3.quantize_drafter} drafter weights" in line
    assert line.endswith(f"; default: tuned on this machine {date.today().isoformat()}]")

    record_path(BF16, CPU).write_text("{not json")
    fallback = run_cli(*args)  # in a process of its own: all it prints
    lines = fallback.stderr.strip().splitlines()
    assert fallback.returncode == 0 and "Traceback" not in fallback.stderr, fallback.stderr
    warnings = [line for line in lines if line.startswith("WARNING medusa_heads.inference.tuned:")]
    assert len(warnings) == 1, fallback.stderr
    drafter, options = default_drafter(BF16)
    assert f"drafter {drafter} (tree {options['tree']})" in lines[-1]
    assert lines[-1].endswith("; default: the project's table; run `medusa-heads tune` to pick for this machine]")
