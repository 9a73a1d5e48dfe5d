"""``python -m ddtree_jax.generate``: bad inputs, output formats, and generation against the fixtures.

Three groups:
- bad inputs, in-process through ``main([...])`` (fast; nothing is loaded): exit 2, one ``error:`` line;
- the output plumbing (JSON schema, streaming, clean stdout) with ``decode.generate`` and the weight loader
  replaced by fakes, so it is tested independently of the model;
- real generation on the fixture pair, compared with generate.json (``needs_decode``: skipped while
  ``decode.generate`` is still a stub or ``ddtree_jax.weights`` does not exist).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import types

import pytest

from ddtree_jax import cli, decode
from ddtree_jax import generate as gen
from ddtree_jax.tokenizer import load_tokenizer
from ddtree_jax.tuning import Tuning

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")
TARGET = os.path.join(FIXTURES, "target")
DRAFT = os.path.join(FIXTURES, "draft")
LLAMA = os.path.join(FIXTURES, "llama_target")  # has no tokenizer.json
with open(os.path.join(FIXTURES, "generate.json")) as _f:
    REFERENCE = json.load(_f)
RUNS = REFERENCE["runs"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decode_ready() -> bool:
    if importlib.util.find_spec("ddtree_jax.weights") is None:
        return False
    return not inspect.getsource(decode.generate).rstrip().endswith("raise NotImplementedError")


needs_decode = pytest.mark.skipif(not _decode_ready(), reason="decode.generate is a stub or ddtree_jax.weights is missing")


def _ids(ids) -> str:
    return ",".join(str(i) for i in ids)


def run_main(capsys, *argv):
    code = gen.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err
    for frag in fragments:
        assert frag in errors[0], errors[0]


# ---------------------------------------------------------------------------------------- bad inputs
BAD = {
    "no_prompt": (["--target", TARGET], ["--prompt"]),
    "missing_target": (["--target", "/no/such/model", "--prompt", "hi"], ["/no/such/model"]),
    "target_is_file": (["--target", os.path.join(TARGET, "config.json"), "--prompt", "hi"], ["not a directory"]),
    "missing_draft": (["--target", TARGET, "--draft", "/no/such/draft", "--method", "ddtree", "--prompt-ids", "1"],
                      ["/no/such/draft"]),
    "ddtree_without_draft": (["--target", TARGET, "--method", "ddtree", "--prompt-ids", "1"], ["--draft"]),
    "dflash_without_draft": (["--target", TARGET, "--method", "dflash", "--prompt-ids", "1"], ["--draft"]),
    "draft_not_dflash": (["--target", TARGET, "--draft", TARGET, "--method", "ddtree", "--prompt-ids", "1"],
                         ["DFlash"]),
    "draft_wrong_target": (["--target", LLAMA, "--draft", DRAFT, "--method", "ddtree", "--prompt-ids", "1"],
                           ["drafter"]),
    "bad_method": (["--target", TARGET, "--method", "beam", "--prompt-ids", "1"], ["--method"]),
    "bad_dtype": (["--target", TARGET, "--dtype", "float16", "--prompt-ids", "1"], ["--dtype"]),
    "bad_attention": (["--target", TARGET, "--attention", "flash", "--prompt-ids", "1"], ["--attention"]),
    "negative_temperature": (["--target", TARGET, "--temperature", "-0.5", "--prompt-ids", "1"], ["--temperature"]),
    "nan_temperature": (["--target", TARGET, "--temperature", "nan", "--prompt-ids", "1"], ["--temperature"]),
    "top_p_zero": (["--target", TARGET, "--top-p", "0", "--prompt-ids", "1"], ["--top-p"]),
    "top_p_above_one": (["--target", TARGET, "--top-p", "1.5", "--prompt-ids", "1"], ["--top-p"]),
    "negative_top_k": (["--target", TARGET, "--top-k", "-1", "--prompt-ids", "1"], ["--top-k"]),
    "zero_max_new_tokens": (["--target", TARGET, "--max-new-tokens", "0", "--prompt-ids", "1"], ["--max-new-tokens"]),
    "zero_tree_budget": (["--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "0",
                          "--prompt-ids", "1"], ["--tree-budget"]),
    "word_tree_budget": (["--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "big",
                          "--prompt-ids", "1"], ["--tree-budget", "auto or an integer"]),
    "non_integer_seed": (["--target", TARGET, "--seed", "x", "--prompt-ids", "1"], ["--seed"]),
    "prompt_ids_letters": (["--target", TARGET, "--prompt-ids", "1,a,3"], ["--prompt-ids"]),
    "prompt_ids_empty_item": (["--target", TARGET, "--prompt-ids", "1,,3"], ["--prompt-ids"]),
    "prompt_ids_empty": (["--target", TARGET, "--prompt-ids", ""], ["--prompt-ids"]),
    "prompt_ids_negative": (["--target", TARGET, "--prompt-ids", "1,-2"], ["--prompt-ids"]),
    "prompt_ids_out_of_vocab": (["--target", TARGET, "--prompt-ids", "1,256,2"], ["vocabulary", "256"]),
    "second_prompt_out_of_vocab": (["--target", TARGET, "--prompt-ids", "1", "--prompt-ids", "9999"],
                                   ["prompt 2", "9999"]),
    "prompt_and_prompt_ids": (["--target", TARGET, "--prompt", "hi", "--prompt-ids", "1"], ["--prompt"]),
    "text_prompt_without_tokenizer": (["--target", LLAMA, "--prompt", "hi"], ["tokenizer.json", "--prompt-ids"]),
    "empty_text_prompt": (["--target", TARGET, "--prompt", "", "--no-chat-template"], ["empty"]),
    "prompt_too_long_ar": (["--target", TARGET, "--prompt-ids", _ids([1] * 4000), "--max-new-tokens", "128"],
                           ["too long", "max_position_embeddings=4096"]),
    "prompt_too_long_tree": (["--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "64",
                              "--prompt-ids", _ids([1] * 3950), "--max-new-tokens", "128"],
                             ["too long", "tree budget 64", "4143"]),
    "stop_ids_out_of_vocab": (["--target", TARGET, "--prompt-ids", "1", "--stop-token-ids", "5,400"],
                              ["--stop-token-ids", "400"]),
    "stop_ids_malformed": (["--target", TARGET, "--prompt-ids", "1", "--stop-token-ids", "5;6"], ["--stop-token-ids"]),
    "unknown_flag": (["--target", TARGET, "--prompt-ids", "1", "--beam-width", "4"], ["--beam-width"]),
    "bad_tuning": (["--target", TARGET, "--prompt-ids", "1", "--tuning", "add_norm=xla"], ["--tuning", "add_norm"]),
    "random_unknown_shape": (["--target", "random:qwen9", "--prompt-ids", "1"], ["unknown random shape 'qwen9'",
                                                                                 "random:tiny"]),
    "random_with_draft": (["--target", "random:tiny", "--draft", DRAFT, "--prompt-ids", "1"], ["drafter is random"]),
    "random_text_prompt": (["--target", "random:tiny", "--prompt", "hi"], ["random model random:tiny", "--prompt-ids"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line(capsys, name):
    argv, fragments = BAD[name]
    assert_one_line_error(*run_main(capsys, *argv), *fragments)


def test_default_pair_offline_is_one_line(capsys, monkeypatch, tmp_path):
    """No --target runs the default pair; when its first-use download cannot happen: one error line."""
    monkeypatch.setenv("DDTREE_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    code, out, err = run_main(capsys, "--prompt", "hi")
    assert code != 0 and out == ""
    assert_one_line_error(code, out, err, "default")


def test_prompt_fits_exactly(capsys, monkeypatch):
    """The length check is not off by one: prompt + new + budget + 1 == max_position_embeddings passes."""
    seen = _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "64",
                              "--prompt-ids", _ids([1] * (4096 - 128 - 64 - 1)), "--max-new-tokens", "128", "--json")
    assert code == 0, err
    assert len(seen["prompts"][0]) == 4096 - 193


@pytest.mark.parametrize("bad", ["{", '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}'])
def test_bad_config_json(capsys, tmp_path, bad):
    (tmp_path / "config.json").write_text(bad)
    code, out, err = run_main(capsys, "--target", str(tmp_path), "--prompt-ids", "1")
    assert_one_line_error(code, out, err)


def test_dir_without_config(capsys, tmp_path):
    assert_one_line_error(*run_main(capsys, "--target", str(tmp_path), "--prompt-ids", "1"), "config.json")


# ---------------------------------------------------------------------------------------- fakes
def _fake_result(prompts, options, new=(104, 195, 169, 33)):
    """What decode.generate returns: each prompt + `new` (b'h\\xc3\\xa9!' = 'hé!' in the byte vocabulary)."""
    n = min(len(new), options.max_new_tokens)
    tree = {"tree": {"node_token_ids": [1, 2], "node_depths": [1, 2], "parents": [-1, 0, 1]}, "accepted_indices": [0, 1]}
    spec = options.method != "ar"
    return decode.GenerateResult(
        output_ids=[list(p) + list(new[:n]) for p in prompts],
        num_generated=[n] * len(prompts),
        acceptance_lengths=[[2, 1] if spec else [] for _ in prompts],
        rounds=[[tree, tree] for _ in prompts] if options.trace and spec else None,
        prefill_s=0.25,
        decode_s=0.5,
    )


def _install_fakes(monkeypatch, *, noisy=False, split=True, raise_in_load=None):
    """Replace the weight loader and decode.generate; return a dict of what generate was called with."""
    seen = {}

    def load_target(path, dtype):
        if raise_in_load is not None:
            raise raise_in_load
        seen["target"] = (path, str(dtype))
        return ("target-config", "target-params")

    def load_draft(path, dtype):
        seen["draft"] = (path, str(dtype))
        return ("draft-config", "draft-params")

    def fake_generate(target, prompts, options, draft=None, on_tokens=None, mesh=None, tuning=None, persist_costs=False):
        seen.update(target=seen.get("target"), prompts=prompts, options=options, draft_arg=draft, tuning=tuning)
        if noisy:  # what a library might print: Python-level and C-level writes to stdout
            print("noise from python")
            os.write(1, b"noise from C\n")
        result = _fake_result(prompts, options)
        if on_tokens is not None and split:
            gen_ids = [out[len(p):] for p, out in zip(prompts, result.output_ids)]
            on_tokens([g[:2] for g in gen_ids])  # 'h' and the first byte of 'é': the 'é' must wait
            on_tokens([g[2:3] for g in gen_ids])
        return result

    monkeypatch.setattr(gen, "_weights", lambda: types.SimpleNamespace(load_target=load_target, load_draft=load_draft))
    monkeypatch.setattr(decode, "generate", fake_generate)
    return seen


# ---------------------------------------------------------------------------------------- output plumbing
def test_json_schema_ar(capsys, monkeypatch):
    seen = _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", TARGET, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--json",
                              "--dtype", "float32", "--max-new-tokens", "7")
    assert code == 0, err
    doc = json.loads(out)
    assert out.count("\n") == 1
    assert set(doc) == {"results", "timing"}
    r0, r1 = doc["results"]
    assert r0 == {"output_ids": [1, 2, 3, 104, 195, 169, 33], "generated_text": "hé!", "num_generated": 4,
                  "acceptance_lengths": [], "mean_acceptance_length": None}
    assert r1["output_ids"] == [4, 5, 104, 195, 169, 33]
    assert doc["timing"] == {"compile_s": 0.0, "prefill_s": 0.25, "decode_s": 0.5, "decode_tokens_per_s": 16.0}
    assert seen["target"] == (TARGET, "float32")
    assert seen["options"] == decode.GenerateOptions(method="ar", max_new_tokens=7, stop_token_ids=())
    assert seen["draft_arg"] is None


def test_json_ddtree_trace_and_options(capsys, monkeypatch):
    seen = _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "4",
                              "--prompt-ids", "1", "--json", "--trace", "--temperature", "0.7", "--top-p", "0.9",
                              "--top-k", "20", "--seed", "3", "--stop-token-ids", "10,33", "--attention", "xla",
                              "--tuning", "add_norm=0,prefill_chunk=64")
    assert code == 0, err
    (r,) = json.loads(out)["results"]
    assert r["acceptance_lengths"] == [2, 1] and r["mean_acceptance_length"] == 1.5
    assert len(r["rounds"]) == 2 and r["rounds"][0]["accepted_indices"] == [0, 1]
    assert seen["options"] == decode.GenerateOptions(method="ddtree", max_new_tokens=128, tree_budget=4,
                                                     temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(10, 33),
                                                     attention="xla", trace=True, seed=3)
    assert seen["tuning"] == Tuning(add_norm=False, prefill_chunk=64)
    assert seen["draft_arg"] == ("draft-config", "draft-params")
    assert seen["target"] == (TARGET, "bfloat16")  # the default dtype


@needs_decode
def test_random_target_runs_ddtree_by_default_with_ar_s_output(capsys):
    """--target random:SHAPE: random weights of the shape and its drafter, nothing read from disk; ddtree by default,
    its greedy output the target's own (AR's on the same weights)."""
    base = ["--target", "random:tiny-moe", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--dtype", "float32",
            "--json"]
    runs = {}
    for method in ("ddtree", "ar"):
        code, out, err = run_main(capsys, *base, *(["--method", "ar"] if method == "ar" else ["--tree-budget", "4"]))
        assert code == 0, err
        runs[method] = json.loads(out)["results"][0]
    assert runs["ddtree"]["acceptance_lengths"] and not runs["ar"]["acceptance_lengths"]  # ddtree ran: it drafted
    assert runs["ddtree"]["output_ids"] == runs["ar"]["output_ids"] and runs["ar"]["num_generated"] == 8
    assert "built random tiny-moe weights" in err and "generated_text" not in runs["ar"]


def test_json_without_tokenizer_has_no_text(capsys, monkeypatch):
    _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", LLAMA, "--prompt-ids", "1,2", "--json")
    assert code == 0, err
    (r,) = json.loads(out)["results"]
    assert "generated_text" not in r and r["num_generated"] == 4


def test_json_stdout_stays_clean(capfd, monkeypatch):
    """Anything printed during loading/generation (Python or C level) goes to stderr, not into the JSON."""
    _install_fakes(monkeypatch, noisy=True)
    code = gen.main(["--target", TARGET, "--prompt-ids", "1", "--json"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert json.loads(out)["results"][0]["num_generated"] == 4
    assert "noise from python" in err and "noise from C" in err


def test_text_prompt_uses_chat_template(capsys, monkeypatch):
    seen = _install_fakes(monkeypatch)
    tok = load_tokenizer(TARGET)
    assert gen.main(["--target", TARGET, "--prompt", "hi", "--json"]) == 0
    assert seen["prompts"] == [list(b"[user]\nhi\n[assistant]\n")]
    assert seen["prompts"][0] == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert gen.main(["--target", TARGET, "--prompt", "hi", "--prompt", "yo", "--no-chat-template", "--json"]) == 0
    assert seen["prompts"] == [list(b"hi"), list(b"yo")]
    capsys.readouterr()


def test_streamed_text_and_summary(capsys, monkeypatch):
    _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", TARGET, "--draft", DRAFT, "--method", "dflash", "--prompt", "hi")
    assert code == 0, err
    assert out == "hé!\n"  # the split 'é' is written whole; the last token arrives only with the result
    summary = err.splitlines()[-1]
    assert "4 tokens" in summary and "8.0 tok/s" in summary and "mean acceptance length 1.50" in summary


def test_the_default_pairs_speed_line_keeps_each_methods_faster_run(capsys, monkeypatch):
    """The default pair's demo times its method and AR again, twice each, interleaved, on the decode loop alone, and
    keeps each one's faster run: a run slowed by other work on the machine does not make the ratio."""
    _install_fakes(monkeypatch)
    fake, calls = decode.generate, []
    slowed = {2: 3.0, 5: 4.0}  # calls 2 and 5: the method's first timing and AR's second

    def timed(target, prompts, options, **kw):
        calls.append(options.method)
        seconds = (0.5 if options.method == "ar" else 0.25) * slowed.get(len(calls), 1.0)
        return dataclasses.replace(fake(target, prompts, options, **kw), decode_s=seconds)

    monkeypatch.setattr(decode, "generate", timed)
    plan = gen.plan
    monkeypatch.setattr(gen, "plan", lambda args: dataclasses.replace(plan(args), compare_ar=True))
    code, out, err = run_main(capsys, "--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--prompt", "hi")
    assert code == 0, err
    assert calls == ["ddtree", "ddtree", "ar", "ddtree", "ar"]  # the streamed run, then the timed pairs
    assert err.splitlines()[-1] == "speed (decode loop only): ddtree 16.0 tok/s, ar 8.0 tok/s: 2.00x AR"


def test_streamed_ids_without_tokenizer(capsys, monkeypatch):
    _install_fakes(monkeypatch)
    code, out, err = run_main(capsys, "--target", LLAMA, "--prompt-ids", "1,2")
    assert code == 0, err
    assert out.split() == ["104", "195", "169", "33"]
    assert "acceptance" not in err.splitlines()[-1]  # ar


def test_batch_text_output(capsys, monkeypatch):
    _install_fakes(monkeypatch, split=False)
    code, out, err = run_main(capsys, "--target", TARGET, "--prompt-ids", "1", "--prompt-ids", "2,3")
    assert code == 0, err
    assert out == "--- sequence 0 ---\nhé!\n--- sequence 1 ---\nhé!\n"


def test_loader_errors_are_one_line(capsys, monkeypatch):
    class WeightsError(ValueError):
        pass

    _install_fakes(monkeypatch, raise_in_load=WeightsError("model.safetensors: missing tensors ['lm_head.weight']\nmore"))
    assert_one_line_error(*run_main(capsys, "--target", TARGET, "--prompt-ids", "1"), "lm_head.weight")
    _install_fakes(monkeypatch, raise_in_load=FileNotFoundError("no model.safetensors"))
    assert_one_line_error(*run_main(capsys, "--target", TARGET, "--prompt-ids", "1"), "no model.safetensors")


def test_interrupt_exits_130(capsys, monkeypatch):
    _install_fakes(monkeypatch, raise_in_load=KeyboardInterrupt())
    code, out, err = run_main(capsys, "--target", TARGET, "--prompt-ids", "1")
    assert code == 130 and err.strip() == "error: interrupted"


def test_internal_error_is_one_line(capsys, monkeypatch):
    _install_fakes(monkeypatch, raise_in_load=RuntimeError("boom"))
    code, out, err = run_main(capsys, "--target", TARGET, "--prompt-ids", "1")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: internal error: RuntimeError: boom")
    assert cli.DEBUG_ENV in err


def test_out_of_device_memory_says_what_to_do(capsys, monkeypatch):
    """XLA's allocation failure is the device's memory, not a bug: one line naming JAX's share of the GPU and the
    variable that raises it."""
    _install_fakes(monkeypatch, raise_in_load=RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB.\nBufferAssignment OOM Debugging."))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    code, out, err = run_main(capsys, "--target", TARGET, "--prompt-ids", "1")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: out of device memory: RESOURCE_EXHAUSTED")
    assert "0.75 (JAX's default)" in err and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in err and "--max-batch" in err


def test_cli_helpers():
    assert cli.one_line("a\n  b\tc") == "a b c"
    assert cli.int_list(" 1, 2,3 ") == [1, 2, 3]
    assert gen._stop_ids("none") == () and gen._stop_ids("7") == (7,)
    assert gen.required_positions(10, decode.GenerateOptions(method="ddtree", max_new_tokens=5, tree_budget=4)) == 20
    assert gen.required_positions(10, decode.GenerateOptions(method="dflash", max_new_tokens=5), block_size=8) == 24
    assert gen.required_positions(10, decode.GenerateOptions(method="ar", max_new_tokens=5)) == 16


# ---------------------------------------------------------------------------------------- subprocess
def _subprocess(*argv):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(cli.DEBUG_ENV, None)
    return subprocess.run([sys.executable, "-m", "ddtree_jax.generate", *argv], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def test_help_subprocess():
    p = _subprocess("--help")
    assert p.returncode == 0 and p.stderr == ""
    for flag in ("--target", "--draft", "--method", "--tree-budget", "--prompt", "--prompt-ids", "--no-chat-template",
                 "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop-token-ids", "--dtype",
                 "--attention", "--trace", "--json", "mean_acceptance_length"):
        assert flag in p.stdout, flag


def test_bad_input_subprocess():
    p = _subprocess("--target", TARGET, "--prompt-ids", "1,999")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------- real generation
def _generate_json(capsys, *argv):
    code, out, err = run_main(capsys, "--target", TARGET, "--dtype", "float32", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


@needs_decode
@pytest.mark.parametrize("i", range(len(RUNS)))
def test_ar_matches_reference(capsys, i):
    run = RUNS[i]
    doc = _generate_json(capsys, "--prompt-ids", _ids(run["prompt"]), "--max-new-tokens", str(run["max_new_tokens"]))
    (r,) = doc["results"]
    assert r["output_ids"] == run["ar"]
    assert r["num_generated"] == run["max_new_tokens"]
    assert r["acceptance_lengths"] == [] and r["mean_acceptance_length"] is None
    assert "generated_text" in r


@needs_decode
def test_ar_batch_matches_reference(capsys):
    longest = max(r["max_new_tokens"] for r in RUNS)
    args = [a for r in RUNS for a in ("--prompt-ids", _ids(r["prompt"]))]
    doc = _generate_json(capsys, *args, "--max-new-tokens", str(longest))
    for run, r in zip(RUNS, doc["results"]):
        assert r["output_ids"][:len(run["ar"])] == run["ar"]  # greedy: a longer run extends the shorter one


@needs_decode
def test_ddtree_trace_matches_reference(capsys):
    """The CLI plumbing of --trace on one prompt; test_decode covers every prompt and budget."""
    run, ref = RUNS[0], RUNS[0]["ddtree"]["4"]
    doc = _generate_json(capsys, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", "4", "--trace",
                         "--prompt-ids", _ids(run["prompt"]), "--max-new-tokens", str(run["max_new_tokens"]))
    (r,) = doc["results"]
    assert r["output_ids"] == ref["output"] == run["ar"]
    assert r["acceptance_lengths"] == ref["acceptance_lengths"]
    assert r["mean_acceptance_length"] == pytest.approx(sum(ref["acceptance_lengths"]) / len(ref["acceptance_lengths"]))
    assert len(r["rounds"]) == len(ref["rounds"])
    for mine, theirs in zip(r["rounds"], ref["rounds"]):
        assert set(mine) == {"tree", "accepted_indices", "target_choices"}
        assert len(mine["target_choices"]) == 1 + len(mine["tree"]["node_token_ids"])
        assert set(mine["tree"]) >= {"node_token_ids", "node_depths", "parents"}
        assert len(mine["accepted_indices"]) == len(theirs["accepted_indices"])


@needs_decode
def test_dflash_matches_reference(capsys):
    run = RUNS[0]
    doc = _generate_json(capsys, "--draft", DRAFT, "--method", "dflash", "--forms", "chain",  # the chain every round
                         "--prompt-ids", _ids(run["prompt"]), "--max-new-tokens", str(run["max_new_tokens"]))
    (r,) = doc["results"]
    assert r["output_ids"] == run["dflash"]["output"] and set(r["round_forms"]) == {"chain"}
    (timed, final), = doc["timing"]["form_costs_ms"].values()  # the one form's ms a round: timed, then refined
    assert timed > 0 and final > 0 and list(doc["timing"]["form_costs_ms"]) == ["chain"]
    assert r["acceptance_lengths"] == run["dflash"]["acceptance_lengths"]


@needs_decode
@pytest.mark.parametrize("chat", [True, False])
def test_text_in_text_out(capsys, chat):
    tok = load_tokenizer(TARGET)
    flags = [] if chat else ["--no-chat-template"]
    doc = _generate_json(capsys, "--prompt", "Hello, wörld", "--max-new-tokens", "12", *flags)
    (r,) = doc["results"]
    prompt = tok.encode_chat([{"role": "user", "content": "Hello, wörld"}]) if chat else tok.encode("Hello, wörld")
    assert r["output_ids"][:len(prompt)] == prompt
    assert r["num_generated"] == 12 == len(r["output_ids"]) - len(prompt)
    assert r["generated_text"] == tok.decode(r["output_ids"][len(prompt):])


@needs_decode
def test_streamed_text_equals_json_text(capsys):
    doc = _generate_json(capsys, "--prompt", "Hi", "--max-new-tokens", "16")
    code, out, err = run_main(capsys, "--target", TARGET, "--dtype", "float32", "--prompt", "Hi", "--max-new-tokens", "16")
    assert code == 0, err
    assert out == doc["results"][0]["generated_text"] + "\n"
    assert "16 tokens" in err.splitlines()[-1]
