"""Every bad command-line input: one line on stderr naming the problem, the documented exit code,
no traceback, before any work. docs/ERRORS.md is this table; the test fails if they differ
(MOESTREAM_WRITE_ERRORS_DOC=1 rewrites the file)."""
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from moestream.commands.ab import main as ab_main
from moestream.commands.engine_args import machine_cores
from moestream.commands.heatmap import main as heatmap_main
from moestream.commands.bench import main as bench_main
from moestream.commands.convert import main as convert_main
from moestream.commands.pull import main as pull_main
from moestream.commands.generate import main as generate_main
from moestream.commands.fit_lookahead import main as fit_lookahead_main
from moestream.commands.serve import main as serve_main
from moestream.commands.simulate import main as simulate_main
from moestream.commands.synth import main as synth_main
from moestream.commands.timeline import main as timeline_main
from moestream.commands.verify import main as verify_main

DOC = Path(__file__).resolve().parents[2] / "docs" / "ERRORS.md"
MAINS = {"generate": generate_main, "serve": serve_main, "bench": bench_main, "convert": convert_main,
         "pull": pull_main, "simulate": simulate_main,
         "ab": ab_main, "heatmap": heatmap_main, "fit-lookahead": fit_lookahead_main, "synth": synth_main,
         "verify": verify_main, "timeline": timeline_main}

# (command, arguments, exit code, the exact stderr line); {missing}, {port}, {file}, {trace} are
# filled in per run and shown as such in the document
CASES = [
    ("generate", "--threads 0", 2, "moestream generate: error: argument --threads: must be at least 1, not 0"),
    ("generate", "--logprobs -1", 2, "moestream generate: error: argument --logprobs: must be at least 0, not -1"),
    ("generate", "--prefill-chunk-tokens 0", 2,
     "moestream generate: error: argument --prefill-chunk-tokens: must be at least 1, not 0"),
    ("generate", "--device cpu --memory-budget 100MiB", 2,
     "moestream generate: error: --memory-budget 100.00 MiB cannot fit this model: it needs at least 412.08 MiB "
     "(resident weights 2.80 MiB, KV cache 16.00 MiB, workspace 9.05 MiB, runtime 384.00 MiB, 4 expert slots "
     "224.00 KiB); a smaller --max-context lowers it"),
    ("generate", "--max-context 0", 2, "moestream generate: error: argument --max-context: must be at least 2, not 0"),
    ("generate", "--max-new 0", 2, "moestream generate: error: argument --max-new: must be at least 1, not 0"),
    ("generate", "--temperature nan", 2, "moestream generate: error: argument --temperature: must be a finite number, not nan"),
    ("generate", "--temperature inf", 2, "moestream generate: error: argument --temperature: must be a finite number, not inf"),
    ("generate", "--temperature -0.5", 2, "moestream generate: error: argument --temperature: must be at least 0, not -0.5"),
    ("generate", "--top-p 0", 2, "moestream generate: error: argument --top-p: must be in (0, 1], not 0"),
    ("generate", "--top-p 1.5", 2, "moestream generate: error: argument --top-p: must be in (0, 1], not 1.5"),
    ("generate", "--receipt {missing}/r.json", 2,
     "moestream generate: error: argument --receipt: the folder {missing} does not exist"),
    ("generate", "--trace-routing {missing}/t.npz", 2,
     "moestream generate: error: argument --trace-routing: the folder {missing} does not exist"),
    ("generate", "--speculative bigram", 2,
     "moestream generate: error: argument --draft/--speculative: bigram is not a packed model (no moestream.json); "
     "give off, auto, ngram, mtp or a draft model's folder"),
    ("generate", "--draft {missing}", 2,
     "moestream generate: error: argument --draft/--speculative: {missing} is not a packed model (no moestream.json); "
     "give off, auto, ngram, mtp or a draft model's folder"),
    ("generate", "--draft {other_model}", 2,
     "moestream generate: error: argument --draft/--speculative: {other_model} does not share the model's tokenizer "
     "(a vocabulary of 320 tokens, the model's has 6144)"),
    ("generate", "--draft-max 0", 2, "moestream generate: error: argument --draft-max/--max-draft-tokens: must be at "
                                     "least 1, not 0"),
    ("generate", "--draft-tokens -1", 2, "moestream generate: error: argument --draft-tokens: must be at least 0, not -1"),
    ("generate", "--hot-head --temperature 0.5", 2,
     "moestream generate: error: argument --hot-head: the hot-vocabulary head decodes greedily only (temperature 0)"),
    ("generate", "--devices cpu,cuda:0", 2,
     "moestream generate: error: argument --devices: all devices must be of one kind (all cpu, or all cuda:N)"),
    ("generate", "--devices cpu,cpu --speculative ngram", 2,
     "moestream generate: error: argument --draft/--hot-head: not with expert parallelism (--devices, torchrun)"),
    ("generate", "--expert-placement {missing}/t.npz", 2, "moestream generate: error: argument --expert-placement: "
                                                          "only with expert parallelism (--devices with 2 or more, torchrun)"),
    ("generate", "--devices cpu,cpu --expert-placement {missing}/t.npz", 2,
     "moestream generate: error: argument --expert-placement: no routing trace at {missing}/t.npz"),
    ("generate", "--cpu-experts 1.5", 2,
     "moestream generate: error: argument --cpu-experts: the share must be between 0 and 1, not 1.5"),
    ("generate", "--devices cpu,cpu --cpu-experts 0.5", 2,
     "moestream generate: error: argument --cpu-experts: not with expert parallelism (--devices, torchrun)"),
    ("generate", "--lookahead-maps {missing}/m.safetensors", 2,
     "moestream generate: error: argument --lookahead-maps: no such file: {missing}/m.safetensors"),
    ("generate", "--cache-size 0", 2, "moestream generate: error: argument --cache-size: 0 holds no expert (give "
                                      "bytes like 4GiB, a share like 25%, min or all)"),
    ("generate", "--cache-size 500%", 2,
     "moestream generate: error: argument --cache-size: a share must be in (0%, 100%], not 500%"),
    ("generate", "--host-cache-size 200%", 2,
     "moestream generate: error: argument --host-cache-size: a share must be in (0%, 100%], not 200%"),
    ("generate", "--memory-budget lots", 2, "moestream generate: error: argument --memory-budget: cannot read size "
                                            "'lots' (examples: 4GiB, 512MB, 1000000)"),
    ("generate", "--threads 100000", 2,
     "moestream generate: error: argument --threads: 100000 is more than the {cores} cores this process may use"),
    ("generate", "--device mps", 2, "moestream generate: error: argument --device: 'mps': only cpu and cuda are supported"),
    ("generate", "--device gpu0", 2,
     "moestream generate: error: argument --device: 'gpu0' is not a device (cpu, cuda or cuda:N)"),
    ("generate", "--model {other_model} --max-context 3000000", 2,
     "moestream generate: error: argument --max-context: 3000000 is more than the model's 256 positions"),
    ("generate", "--seed -1", 2, "moestream generate: error: argument --seed: must be at least 0, not -1"),
    ("generate", "--prompt-ids 1,x", 2,
     "moestream generate: error: argument --prompt-ids: must be comma-separated whole numbers, not '1,x'"),
    ("bench", "--cpu-experts fast", 2,
     "moestream bench: error: argument --cpu-experts: 'fast' is not off, auto or a share between 0 and 1"),
    ("bench", "--out {missing}/b.json", 2, "moestream bench: error: argument --out: the folder {missing} does not exist"),
    ("bench", "--cache-sizes 10%,0", 2, "moestream bench: error: argument --cache-sizes: 0 holds no expert (give "
                                        "bytes like 4GiB, a share like 25%, min or all)"),
    ("bench", "--model {other_model} --prefill-tokens 128,4096", 2,
     "moestream bench: error: argument --prefill-tokens: 4096 tokens do not fit the context of 256 tokens (at most "
     "254; --max-context sets the context)"),
    ("bench", "--prefill-tokens 512,lots", 2,
     "moestream bench: error: argument --prefill-tokens: 'lots' is not a positive number of tokens"),
    ("bench", "--step-tokens 99", 2,
     "moestream bench: error: argument --step-tokens: '99' is not a token count of 1..16"),
    ("bench", "--routing often", 2,
     "moestream bench: error: argument --routing 'often': choose model, uniform, zipf:S[:L] or trace:FILE"),
    ("bench", "--seed -1", 2, "moestream bench: error: argument --seed: must be at least 0, not -1"),
    ("ab", "true true --rounds 1", 2, "moestream ab: error: argument --rounds: must be at least 2, not 1"),
    ("ab", "true true", 1, "moestream ab: error: command A printed no number on its last line (true)"),
    ("convert", "SRC OUT --workers 0", 2, "moestream convert: error: argument --workers: must be at least 1, not 0"),
    ("pull", "./folder OUT", 1, "moestream pull: error: './folder' is not a Hub repo id (owner/name); to pack a local "
                                "folder use moestream convert"),
    ("serve", "--top-p 2", 2, "moestream serve: error: argument --top-p: must be in (0, 1], not 2"),
    ("serve", "--temperature 3", 2, "moestream serve: error: argument --temperature: must be between 0 and 2, not 3.0"),
    ("serve", "--parallel 0", 2, "moestream serve: error: argument --parallel: must be at least 1, not 0"),
    ("serve", "--threads 0", 2, "moestream serve: error: argument --threads: must be at least 1, not 0"),
    ("serve", "--port 70000", 2, "moestream serve: error: argument --port: must be at most 65535, not 70000"),
    ("serve", "--max-queue -1", 2, "moestream serve: error: argument --max-queue/--queue-size: must be at least 0, "
                                   "not -1"),
    ("serve", "--top-k -5", 2, "moestream serve: error: argument --top-k: must be at least 0, not -5"),
    ("serve", "--cache-size 0", 2, "moestream serve: error: argument --cache-size: 0 holds no expert (give bytes "
                                   "like 4GiB, a share like 25%, min or all)"),
    ("serve", "--hot-head --parallel 2", 2,
     "moestream serve: error: argument --draft/--hot-head: with --parallel above 1 only ngram drafts (a draft model, "
     "MTP and the hot head follow one sequence)"),
    ("serve", "--draft {missing} --parallel 2", 2,
     "moestream serve: error: argument --draft/--speculative: {missing} is not a packed model (no moestream.json); "
     "give off, auto, ngram, mtp or a draft model's folder"),
    ("serve", "--hot-head --draft ngram", 2,
     "moestream serve: error: argument --hot-head: not with --draft (choose one)"),
    ("serve", "--port {port}", 1, "moestream serve: error: cannot listen on 127.0.0.1:{port}: Address already in use "
                                  "(is another server running there? choose another --port)"),
    ("serve", "--model {missing}", 1, "moestream serve: error: {missing}: no such directory"),
    ("simulate", "{file}", 1,
     "moestream simulate: error: {file}: not a routing trace (the .npz file --trace-routing writes)"),
    ("simulate", "{trace} --sizes 0%", 2,
     "moestream simulate: error: argument --sizes: '0%': a share must be more than 0% and at most 100%"),
    ("simulate", "{trace} --plot {missing}/p.png", 2,
     "moestream simulate: error: argument --plot: the folder {missing} does not exist"),
    ("simulate", "{trace} --sizes 10%,-4", 2,
     "moestream simulate: error: argument --sizes: '-4': a slot count must be at least 1"),
    ("fit-lookahead", "{missing}", 2,
     "moestream fit-lookahead: error: argument MODEL: {missing} is not a packed model (no moestream.json)"),
    ("fit-lookahead", "{missing} --rank -1", 2, "moestream fit-lookahead: error: argument --rank: must be at least 0, not -1"),
    ("fit-lookahead", "{missing} --check-share 1.5", 2,
     "moestream fit-lookahead: error: argument --check-share: must be between 0 and 1, not 1.5"),
    ("fit-lookahead", "{other_model} {missing_out} --file-tokens 512", 2,
     "moestream fit-lookahead: error: argument --file-tokens: 512 tokens do not fit the model's context of 256 tokens"),
    ("fit-lookahead", "{other_model} {folder}", 2, "moestream fit-lookahead: error: argument OUT: {folder} is a folder, "
                                                   "not a file"),
    ("synth", "{missing_out} --shape qwen3-30b-a3b --seed -1", 2,
     "moestream synth: error: argument --seed: must be at least 0, not -1"),
    ("synth", "{missing_out} --shape qwen3-30b-a3b --layers 0", 2,
     "moestream synth: error: argument --layers: must be at least 1, not 0"),
    ("verify", "{missing}", 1, "moestream verify: error: {missing}: no such directory"),
    ("timeline", "{file}", 1, "moestream timeline: error: {file}: not JSON"),
    ("heatmap", "{file} {missing}/h.png", 2, "moestream heatmap: error: argument OUT: the folder {missing} does not exist"),
    ("heatmap", "{file} heat.png", 1, "moestream heatmap: error: {file}: not JSON (give a receipt or a bench JSON)"),
]

# Bad MXFP4 checkpoints given to convert (gpt-oss's `X_blocks` / `X_scales`): built and run by
# tests/models/test_mxfp4_records.py; {src} is the checkpoint folder
CONVERT_INPUT_CASES = [
    ("nan scale", 1, "moestream convert: error: model.layers.1.mlp.experts.down_proj_scales: MXFP4 scale 255 (NaN in "
                     "E8M0) at [1, 2, 0]: the checkpoint is corrupt"),
    ("blocks not U8", 1, "moestream convert: error: model.layers.1.mlp.experts.down_proj: MXFP4 blocks and scales must "
                         "be U8, not I8 and U8"),
    ("blocks and scales disagree", 1, "moestream convert: error: model.layers.1.mlp.experts.down_proj: MXFP4 blocks "
                                      "[8, 64, 1, 16] and scales [8, 64, 2] are not [E, Out, G, 16] and [E, Out, G]"),
    ("blocks of another shape than config.json", 1,
     "moestream convert: error: model.layers.1.mlp.experts.down_proj: shape [8, 64, 32], but config.json implies "
     "[8, 64, 64] (num_local_experts × intermediate_size × hidden_size)"),
]


def render() -> str:
    lines = ["# Errors for bad input", "",
             "Every bad input is refused with one line on stderr that names the problem, before any work "
             "starts (no model is opened, nothing is generated), and no traceback. Exit code 2: the command line "
             "is wrong (a flag's value, an output file's folder); exit code 1: the command line is fine but what "
             "it points at is not (a port in use, a file that is not a trace, a model that fails its checks).", "",
             "Generated from `tests/unit/test_errors.py`, which runs every row and fails if this file differs "
             "(`MOESTREAM_WRITE_ERRORS_DOC=1 pytest tests/unit/test_errors.py` rewrites it). `{missing}` is a "
             "folder that does not exist, `{port}` a port in use, `{file}` a file that is not a trace, "
             "`{other_model}` a packed model with another tokenizer (its context: 256 tokens), `{missing_out}` a "
             "path that does not exist yet, `{folder}` a folder, `{cores}` the cores the process may use.", "",
             "`--threads` above the cores is refused rather than lowered: more compute threads than cores only "
             "wait on each other. A reader that goes away (`moestream generate --help | head`) ends the command "
             "quietly with exit code 141, as a shell reports a closed pipe; Ctrl+C ends it with 130.", "",
             "| command | input | exit | message |", "|---|---|---|---|"]
    for command, argv, code, message in CASES:
        lines.append(f"| `{command}` | `{argv}` | {code} | `{message}` |")
    lines += ["", "Damaged model files (checked by default; `--no-verify` skips the checks):", "",
              "| what | exit | message |", "|---|---|---|",
              "| a byte of an expert record flipped | 1 | `moestream generate: error: DIR/experts-LLL.bin: layer L "
              "expert E is corrupt (crc32 …, the manifest says …; `moestream verify` checks every file)` |",
              "| a byte of `dense.safetensors`, a tokenizer file or another resident file changed | 1 | "
              "`moestream generate: error: DIR/FILE: sha256 differs from the manifest (the file is corrupt or was "
              "changed; `moestream verify DIR` checks every file)` |",
              "| the server meets a damaged record | HTTP 500 | the same line as the message of that request's "
              "error; other requests are served |", "",
              "Bad MXFP4 checkpoints (gpt-oss's `X_blocks` / `X_scales`; the tiny gpt-oss damaged as the row says):", "",
              "| what | exit | message |", "|---|---|---|"]
    lines += [f"| {what} | {code} | `{message}` |" for what, code, message in CONVERT_INPUT_CASES]
    lines += [""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_packed_model):
    tmp = tmp_path_factory.mktemp("errors")
    not_a_trace = tmp / "notes.npz"
    not_a_trace.write_text("not an archive\n")
    trace = tmp / "t.npz"
    np.savez(trace, layer=np.zeros(2, np.int16), position=np.arange(2, dtype=np.int32),
             experts=np.array([[0, 1], [1, 2]], np.int16), meta=np.array('{"num_experts": 4}'))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    yield {"missing": str(tmp / "no-such-folder"), "port": str(taken.getsockname()[1]), "file": str(not_a_trace),
           "trace": str(trace), "other_model": str(tiny_packed_model("qwen3_moe", "q4")),
           "missing_out": str(tmp / "not-written"), "cores": str(machine_cores()), "folder": str(tmp)}
    taken.close()


@pytest.mark.parametrize("command,argv,code,message", CASES, ids=[f"{c} {a}" for c, a, _, _ in CASES])
def test_bad_input_is_one_line(command, argv, code, message, places, capsys):
    args = [part.format(**places) for part in argv.split()]
    try:
        rc = MAINS[command](args)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == code
    assert out == ""
    assert err.splitlines() == [message.format(**places)], err
    assert "Traceback" not in err


def test_errors_doc_is_the_table():
    text = render()
    if os.environ.get("MOESTREAM_WRITE_ERRORS_DOC"):
        DOC.write_text(text)
    assert DOC.read_text() == text, "docs/ERRORS.md is stale: MOESTREAM_WRITE_ERRORS_DOC=1 pytest tests/unit/test_errors.py"
