"""The command line: examples/generate.py and ``jaxdecode generate`` (jaxdecode.cli)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxdecode as jd
from jaxdecode import cli
from jaxdecode.params import params_to_hf

from conftest import ROOT, hf_text_config, host_stop, write_hf_tokenizer

EXAMPLE = ROOT / "examples" / "generate.py"


@pytest.fixture(scope="module", autouse=True)
def _xla_cache_in_tmp(tmp_path_factory):
    """The CLI's persistent compilation cache goes to a temporary XDG_CACHE_HOME, not ~/.cache."""
    os.environ["JAXDECODE_TEST_XDG"] = str(tmp_path_factory.mktemp("xdg"))
    yield
    os.environ.pop("JAXDECODE_TEST_XDG")


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XDG_CACHE_HOME=os.environ["JAXDECODE_TEST_XDG"])
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


@pytest.mark.slow
def test_example_runs_on_the_embedded_default():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "random weights" in out and "Qwen3.5 vocabulary" in out
    ids = re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")
    assert len(ids) == 32 and all(0 <= int(i) < 248_320 for i in ids)
    assert re.search(r"^text: ", out, re.M)
    assert re.search(r"compile: [\d.]+ s .*persistent cache .*xdg", out)
    assert re.search(r"[\d.]+ tokens/s", out)


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints, tmp_path_factory):
    """A random HF checkpoint (save_pretrained) plus a small tokenizer.json and chat template."""
    src = hf_checkpoints.make("cli_tiny", hf_text_config(), seed=5)
    dst = tmp_path_factory.mktemp("cli") / "ckpt"
    shutil.copytree(src, dst)
    write_hf_tokenizer(dst)
    return dst


@pytest.mark.slow
@pytest.mark.hf
def test_example_streams_chat_on_a_checkpoint_directory(checkpoint):
    proc = _run("--checkpoint", str(checkpoint), "--prompt", "hello world", "--chat",
                "--stream", "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "tokenizer.json" in out and "<|im_start|>user\\nhello world" in out
    for field in ("compile:", "prefill:", "time to first token:", "tokens/s", "ms/token"):
        assert field in out
    ids = re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")
    assert 1 <= len(ids) <= 6


@pytest.mark.slow
@pytest.mark.hf
def test_example_samples_several_continuations_from_ids(checkpoint):
    proc = _run("--checkpoint", str(checkpoint), "--prompt-ids", "1,2,3", "--num-samples", "2",
                "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("--- sample ") == 2


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-3"], "--top-k"),
    (["--top-k", "99999999999"], "--top-k"),
    (["--seed", "99999999999999999999"], "--seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--num-samples", "x"], "--num-samples"),
    (["--checkpoint", "/nonexistent/dir"], "not a directory"),
    (["--prompt-ids", "1,x"], "comma-separated"),
    (["--prompt", "a", "--prompt-ids", "1"], "not both"),
    (["--stream", "--num-samples", "2"], "--stream"),
    (["--dtype", "float16"], "--dtype"),
])
def test_bad_arguments_exit_with_one_line(capsys, argv, message):
    try:
        status = cli.main(["generate", *argv])
    except SystemExit as e:  # argparse's own checks
        status = e.code
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "error:" in err and message in err, err


def test_sampling_semantics_flags():
    """--no-penalize-prompt / --no-top-p-keep-ties select the other semantics (both on by
    default: the repetition penalty counts the prompt, top-p keeps ties)."""
    parse = lambda *a: cli.build_parser().parse_args(["generate", *a])  # noqa: E731
    default = parse()
    assert default.penalize_prompt is True and default.top_p_keep_ties is True
    other = parse("--no-penalize-prompt", "--no-top-p-keep-ties")
    assert other.penalize_prompt is False and other.top_p_keep_ties is False
    assert default.frequency_penalty == 0
    assert parse("--frequency-penalty", "0.5").frequency_penalty == 0.5


def test_bad_token_ids_exit_with_one_line(capsys):
    status = cli.main(["generate", "--prompt-ids", "1,248320", "--max-new-tokens", "2",
                       "--no-compile-cache"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "vocab_size=248320" in err, err


def test_out_of_vocabulary_ids_are_refused_before_loading_the_weights(tmp_path, capsys):
    """A checkpoint directory with only config.json: the ids are checked against its vocabulary
    first (else the missing weights would be the error)."""
    config = jd.Config.from_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
    for argv, bad in ((["--prompt-ids", "1,-3"], "--prompt-ids"),
                      (["--prompt-ids", "1", "--stop-ids", f"5,{config.vocab_size}"],
                       "--stop-ids")):
        status = cli.main(["generate", "--checkpoint", str(tmp_path), *argv,
                           "--no-compile-cache"])
        err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1, err
        assert f"{bad}: ids must be in [0, vocab_size={config.vocab_size})" in err, err


def test_sampling_summary_names_every_setting_away_from_its_default():
    args = cli.build_parser().parse_args(["generate", "--frequency-penalty", "0.5"])
    assert cli._describe(args) == "greedy, frequency_penalty=0.5"


def test_console_script_is_declared():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["scripts"]["jaxdecode"] == "jaxdecode.cli:main"
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0


# ----- what a new user meets (issue 22)

def test_version_and_usage(capsys):
    for argv in (["--version"], ["generate", "--version"]):
        try:
            cli.main(argv)
        except SystemExit as e:
            assert e.code == 0
        assert capsys.readouterr().out.strip() == f"jaxdecode{' generate' * (len(argv) == 2)} {jd.__version__}"
    assert cli.main([]) == 2
    assert "usage: jaxdecode" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "jaxdecode", "--version"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # python -m jaxdecode: the same
    assert proc.returncode == 0 and proc.stdout.strip() == f"jaxdecode {jd.__version__}", proc


def test_a_mismatched_checkpoint_report_keeps_one_line_per_problem(tmp_path, capsys):
    config = jd.Config.from_preset("tiny")
    params = jd.init_params(config, jax.random.key(0), "float32")
    save_file({k: np.asarray(v) for k, v in params_to_hf(params).items()},
              str(tmp_path / "model.safetensors"))
    wrong = dict(config.to_hf_config(), hidden_size=256)
    (tmp_path / "config.json").write_text(json.dumps(wrong))
    assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1,2",
                     "--no-compile-cache"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("jaxdecode generate: error: checkpoint ")
    assert len(err) > 10 and all(line.startswith("  tensor ") for line in err[1:])


def test_checkpoint_may_be_the_safetensors_file(tmp_path, capsys):
    config = jd.Config.from_preset("tiny")
    params = jd.init_params(config, jax.random.key(0), "float32")
    save_file({k: np.asarray(v) for k, v in params_to_hf(params).items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "model.safetensors"),
                     "--prompt-ids", "1,2", "--max-new-tokens", "2", "--no-compile-cache"]) == 0
    assert "2 tokens" in capsys.readouterr().out
    # speculative decoding drafts with the checkpoint's MTP layer: this one has none
    for where in (tmp_path, tmp_path / "model.safetensors"):
        assert cli.main(["generate", "--checkpoint", str(where), "--prompt-ids", "1,2",
                         "--num-speculative-tokens", "2", "--no-compile-cache"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(
            rf"--num-speculative-tokens: {re.escape(str(tmp_path))} has no MTP layer \(no mtp\.\* "
            r"tensors\) to draft with; run without it", err), err


# ----- stop sequences: --stop / --stop-ids (issue 22) ----------------------------------------

def _cli(capsys, *argv):
    status = cli.main(["generate", "--prompt-ids", "1,2,3", "--no-compile-cache", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.slow
def test_cli_stop_ids_and_stop_text(capsys):
    status, out, _ = _cli(capsys, "--max-new-tokens", "12")
    assert status == 0
    free = [int(i) for i in re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")]
    stop = free[4:6]
    status, out, _ = _cli(capsys, "--max-new-tokens", "12", "--stop-ids",
                          ",".join(map(str, stop)), "--stop-ids", "0")
    assert status == 0
    got = [int(i) for i in re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")]
    assert got == host_stop(free, 12, [stop, [0]])[0]
    assert "stopped by stop" in out and f"stop sequences: [{stop}, [0]]" in out
    status, out, _ = _cli(capsys, "--max-new-tokens", "2", "--stop", "Hello world")
    tok = jd.load_tokenizer(None, jd.Config.from_preset("tiny").vocab_size)
    assert status == 0 and f"stop sequences: [{tok.encode('Hello world')}]" in out


def test_cli_quantize_fp8_generates_on_the_embedded_default(capsys):
    status, out, _ = _cli(capsys, "--max-new-tokens", "3", "--quantize", "fp8")
    assert status == 0, out
    ids = re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")
    assert len(ids) == 3


@pytest.mark.parametrize("argv, message", [
    (["--stop-ids", "1,x"], "--stop-ids '1,x' must be comma-separated integers"),
    (["--stop-ids", "1,,3,"], "--stop-ids '1,,3,' must be comma-separated integers"),
    (["--stop-ids", ""], "--stop-ids is empty"),
    (["--stop", ""], "--stop is empty"),
    (["--stop-ids", "999999999"],
     r"--stop-ids: ids must be in [0, vocab_size=248320); got [999999999]"),
])
def test_cli_bad_stop_arguments_exit_with_one_line(capsys, argv, message):
    status, _, err = _cli(capsys, "--max-new-tokens", "2", *argv)
    assert status == 2 and err.count("\n") == 1 and message in err, err


def test_cli_stop_text_without_a_tokenizer_is_a_clear_error(capsys, monkeypatch):
    from jaxdecode import tokenizer
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda *a: None)
    status, _, err = _cli(capsys, "--max-new-tokens", "2", "--stop", "x")
    assert status == 2 and "--stop needs a tokenizer" in err and "--stop-ids" in err, err


def test_cli_speculative_decoding_gives_the_greedy_tokens(capsys):
    status, out, _ = _cli(capsys, "--max-new-tokens", "10")
    assert status == 0
    plain = re.search(r"^ids: \[(.*)\]$", out, re.M).group(1)
    status, out, _ = _cli(capsys, "--max-new-tokens", "10", "--num-speculative-tokens", "3")
    assert status == 0, out
    assert re.search(r"^ids: \[(.*)\]$", out, re.M).group(1) == plain
    assert "3 drafts per step from the MTP layer" in out
    free = [int(i) for i in plain.split(", ")]  # a stop sequence ends it as in plain decoding
    status, out, _ = _cli(capsys, "--max-new-tokens", "10", "--num-speculative-tokens", "3",
                          "--stop-ids", ",".join(map(str, free[3:5])))
    assert status == 0, out
    got = [int(i) for i in re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")]
    assert got == host_stop(free, 10, [free[3:5]])[0] and "stopped by stop" in out
    status, out, _ = _cli(capsys, "--max-new-tokens", "10", "--num-speculative-tokens", "2",
                          "--stream", "--chunk-size", "2")  # streamed: the same tokens
    assert status == 0, out
    assert re.search(r"^ids: \[(.*)\]$", out, re.M).group(1) == plain
    assert "stopped by length" in out and "compile: " in out
    status, out, _ = _cli(capsys, "--max-new-tokens", "4", "--num-speculative-tokens", "2",
                          "--num-samples", "2", "--temperature", "0.8", "--seed", "3")
    assert status == 0 and out.count("--- sample ") == 2, out


def test_cli_draft_vocab(capsys, tmp_path):
    """--draft-vocab FILE: the same greedy tokens; a bad file or a missing
    --num-speculative-tokens is one usage line."""
    status, out, _ = _cli(capsys, "--max-new-tokens", "8")
    plain = re.search(r"^ids: \[(.*)\]$", out, re.M).group(1)
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, range(0, 512, 2))) + "\n" + ",".join(map(str, range(1, 64, 2))))
    status, out, _ = _cli(capsys, "--max-new-tokens", "8", "--num-speculative-tokens", "2",
                          "--draft-vocab", str(ids))
    assert status == 0, out
    assert re.search(r"^ids: \[(.*)\]$", out, re.M).group(1) == plain
    for text, args, message in (
            ("1 2 x3", ("--num-speculative-tokens", "2"), "token ids must be integers"),
            ("1 2 1", ("--num-speculative-tokens", "2"), r"repeats ids: \[1\]"),
            ("1 2", (), "--draft-vocab needs --num-speculative-tokens")):
        ids.write_text(text)
        status, _, err = _cli(capsys, "--max-new-tokens", "4", *args, "--draft-vocab", str(ids))
        assert status == 2 and err.count("\n") == 1 and re.search(message, err), err
    for missing in (tmp_path / "missing.txt", tmp_path):  # no such file; a directory
        status, _, err = _cli(capsys, "--max-new-tokens", "4", "--num-speculative-tokens", "2",
                              "--draft-vocab", str(missing))
        assert status == 2 and err.count("\n") == 1 and str(missing) in err, err
