"""The zeroplan module against the zero-plan binary: the same inputs give the same JSON, and bad
input the same error and hint. ZP_BIN names the folder holding zero-plan (ctest sets it)."""
import json
import os
import subprocess
import sys

import pytest

import zeroplan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("ZP_BIN", os.path.join(ROOT, "build", "bin"))
MISTRAL = os.path.join(ROOT, "models", "configs", "mistral-7b.json")
BUDGETS = os.path.join(ROOT, "tests", "budgets", "catalog.json")


def cli(*args, code=0):
    """zero-plan's JSON for args (exit code checked)."""
    r = subprocess.run([os.path.join(BIN, "zero-plan"), *args, "--format", "json"],
                       capture_output=True, text=True)
    assert r.returncode == code, r.stderr
    return json.loads(r.stdout)


def cli_error(*args):
    """zero-plan's (error, hint) lines for bad input, which must exit 2."""
    r = subprocess.run([os.path.join(BIN, "zero-plan"), *args], capture_output=True, text=True)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: "), r.stderr
    hint = [l[len("hint: "):] for l in lines if l.startswith("hint: ")]
    return lines[0][len("error: "):], hint[0] if hint else ""


def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def test_estimate_keywords_equal_the_flags():
    got = zeroplan.estimate("gpt2-xl", stage=2, dp=8, micro_batch=4, hardware="v100-32g",
                            offload_optimizer="cpu", flash_attention=True)
    want = cli("estimate", "--model", "gpt2-xl", "--stage", "2", "--dp", "8", "--micro-batch", "4",
               "--hardware", "v100-32g", "--offload-optimizer", "cpu", "--flash-attention")
    assert got == want
    assert got["schema"] == "zero-plan/estimate/v1"
    assert got["strategy"]["stage"] == 2 and got["fits"] is True


def test_strategy_dict_of_keywords_and_profile():
    got = zeroplan.estimate("llama-2-7b", strategy={"stage": 3, "dp": 8}, profile="deepspeed",
                            hardware="a100-80g")
    assert got == cli("estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "8",
                      "--profile", "deepspeed", "--hardware", "a100-80g")


def test_model_as_dict_path_and_directory(tmp_path):
    with open(MISTRAL) as f:
        config = json.load(f)
    want = cli("estimate", "--model", MISTRAL, "--stage", "3", "--dp", "8")
    from_dict = zeroplan.estimate(config, stage=3, dp=8)
    # The same numbers; only the name differs (a dict has no file name).
    assert without(from_dict, "model") == without(want, "model")
    assert without(from_dict["model"], "name") == without(want["model"], "name")
    assert from_dict["model"]["name"] == "model"
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = zeroplan.estimate(tmp_path, stage=3, dp=8)
    assert without(from_dir, "model") == without(want, "model")
    assert zeroplan.estimate(MISTRAL, stage=3, dp=8) == want


def test_model_dict_with_what_to_dict_adds():
    # PretrainedConfig.to_dict() adds its generic attributes and the hub id; they change nothing.
    with open(MISTRAL) as f:
        config = json.load(f)
    plain = zeroplan.estimate(dict(config), stage=2, dp=4)
    config.update({"_name_or_path": "mistralai/Mistral-7B-v0.1", "return_dict": True,
                   "output_hidden_states": False, "torchscript": False, "pruned_heads": {},
                   "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
                   "problem_type": None, "transformers_version": "4.46.0"})
    full = zeroplan.estimate(config, stage=2, dp=4)
    assert full["model"]["name"] == "mistralai/Mistral-7B-v0.1"
    assert without(full, "model") == without(plain, "model")


def test_deepspeed_config_dict_with_auto_equals_the_file(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    want = cli("estimate", "--model", "llama-2-13b", "--ds-config", str(path), "--dp", "8",
               "--profile", "deepspeed")
    got = zeroplan.estimate("llama-2-13b", strategy=ds, dp=8, profile="deepspeed")
    # The "auto" lines name where the config came from: the file, or "strategy".
    assert without(got, "assumed") == without(want, "assumed")
    assert [l.replace(str(path), "strategy") for l in want["assumed"]] == got["assumed"]
    assert any("auto" in l for l in got["assumed"])
    assert zeroplan.estimate("llama-2-13b", strategy=path, dp=8, profile="deepspeed") == want
    # A keyword overrides the config, as a flag does.
    assert zeroplan.estimate("llama-2-13b", strategy=ds, dp=8, micro_batch=2,
                             profile="deepspeed")["strategy"]["micro_batch"] == 2


def test_plan_written_and_returned(tmp_path):
    out = tmp_path / "plan.json"
    got = zeroplan.plan("gpt2-tiny", stage=2, dp=2, output=out)
    subprocess.run([os.path.join(BIN, "zero-plan"), "plan", "--model", "gpt2-tiny", "--stage",
                    "2", "--dp", "2", "-o", str(tmp_path / "cli.json")], check=True)
    with open(tmp_path / "cli.json") as f:
        want = json.load(f)
    assert got == want
    with open(out) as f:
        assert json.load(f) == want
    assert zeroplan.plan("gpt2-tiny", stage=2, dp=2) == want  # no file asked for, none needed


def test_fit_equals_the_cli():
    got = zeroplan.fit("gpt2-xl", hardware="v100-32g", gpus=16, top=3)
    want = cli("fit", "--model", "gpt2-xl", "--hardware", "v100-32g", "--gpus", "16", "--top", "3")
    assert without(got, "search_seconds") == without(want, "search_seconds")
    assert len(got["candidates"]) == 3


def test_fit_nothing_fits_returns_the_closest_miss():
    got = zeroplan.fit("llama-2-70b", hardware="v100-32g", gpus=1, stage=0)
    want = cli("fit", "--model", "llama-2-70b", "--hardware", "v100-32g", "--stage", "0", code=1)
    assert without(got, "search_seconds") == without(want, "search_seconds")
    assert got["candidates"] == []


def test_table_is_the_zero_papers():
    got = zeroplan.table(params=[7.5e9], dp=[64])
    assert got == cli("table", "--params", "7.5e9", "--dp", "64")
    by_stage = {r["stage"]: r["bytes_per_device"] for r in got["rows"]}
    # ZeRO paper Table 1, 7.5B at Nd = 64: 2+2+12 bytes/param unpartitioned; stage 1 keeps
    # 2+2+12/64, stage 2 2+(2+12)/64, stage 3 (2+2+12)/64 (31.4 GB, 16.6 GB, 1.88 GB).
    p = 7.5e9
    assert by_stage[0] == p * 16
    assert by_stage[1] == p * (4 + 12 / 64)
    assert by_stage[2] == p * (2 + 14 / 64)
    assert by_stage[3] == p * 16 / 64


def test_check_and_models_equal_the_cli(tmp_path):
    junit = tmp_path / "check.xml"
    got = zeroplan.check(BUDGETS, junit=junit)
    assert got == cli("check", BUDGETS)
    assert junit.read_text().startswith("<?xml")
    assert zeroplan.models() == cli("models")
    assert zeroplan.models("mixtral-tiny") == cli("models", "mixtral-tiny")


@pytest.mark.parametrize("kwargs, flags", [
    ({"dp": 0}, ["--dp", "0"]),
    ({"stage": 5}, ["--stage", "5"]),
    ({"offload_param": "gpu"}, ["--offload-param", "gpu"]),
    ({"precision": "fp8"}, ["--precision", "fp8"]),
])
def test_errors_are_the_clis(kwargs, flags):
    message, hint = cli_error("estimate", "--model", "gpt2-xl", *flags)
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", **kwargs)
    assert (e.value.message, e.value.hint) == (message, hint)
    assert e.value.field == next(iter(kwargs))


def test_errors_name_the_field():
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", stag=2)
    assert e.value.field == "stag" and "stage" in e.value.hint
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", strategy={"zero_optimization": {"stage": 2, "stage4": 1}})
    assert e.value.field == "zero_optimization.stage4"
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xxl")
    assert e.value.field == "model" and "gpt2-xl" in e.value.hint
    with open(MISTRAL) as f:
        config = json.load(f)
    del config["hidden_size"]
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate(config)
    assert e.value.field == "hidden_size"
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", flash_attention="yes")
    assert e.value.field == "flash_attention"
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", stage=True)
    assert e.value.field == "stage"
    with pytest.raises(zeroplan.Error) as e:
        zeroplan.estimate("gpt2-xl", strategy={"zero_optimization": {"stage": float("nan")}})
    assert e.value.field == "strategy"
    assert str(e.value).startswith("strategy: not JSON data")


def test_failed_plan_writes_nothing(tmp_path):
    out = tmp_path / "plan.json"
    with pytest.raises(zeroplan.Error):
        zeroplan.plan("gpt2-tiny", stage=3, offload_param="nvme", dp=0, output=out)
    assert not out.exists()


def test_python_m_zeroplan_is_zero_plan():
    args = ["estimate", "--model", "gpt2", "--stage", "1", "--dp", "4", "--format", "json"]
    py = subprocess.run([sys.executable, "-m", "zeroplan", *args], capture_output=True, text=True)
    cpp = subprocess.run([os.path.join(BIN, "zero-plan"), *args], capture_output=True, text=True)
    assert (py.returncode, py.stdout, py.stderr) == (cpp.returncode, cpp.stdout, cpp.stderr)
    assert py.returncode == 0 and json.loads(py.stdout)["strategy"]["dp"] == 4
    bad = ["estimate", "--model", "gpt2", "--dp", "0"]
    py = subprocess.run([sys.executable, "-m", "zeroplan", *bad], capture_output=True, text=True)
    cpp = subprocess.run([os.path.join(BIN, "zero-plan"), *bad], capture_output=True, text=True)
    assert (py.returncode, py.stderr) == (2, cpp.stderr)
    helped = subprocess.run([sys.executable, "-m", "zeroplan", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "zero-plan estimate" in helped.stdout
