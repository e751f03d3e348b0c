"""docs/integrations.md's `vllm serve` commands, read by vLLM 0.33.0's own CLI parser, and the connector
class vLLM's factory loads from what it parsed.

Each `vllm serve` line of the document is extracted as tests/test_docs_readme.py extracts blocks, its
`\\` continuations joined and its words split as bash splits them, and handed to the parser
`vllm serve` builds (`FlexibleArgumentParser` with a "serve" subparser filled by
`make_arg_parser`, then `validate_parsed_serve_args`), so a misspelled flag or broken JSON fails
here. `vllm.entrypoints.cli.serve` itself imports uvicorn, which the test venv lacks, so the parser
is built here as that module builds it. Building it needs vLLM's CPU platform
(VLLM_TARGET_DEVICE=cpu), which would change the platform of the other vLLM tests in this process:
the parse runs in one subprocess for every command, which prints what it parsed as JSON.

The extra-config keys the document lists are the ones the connector reads (client/vllm/*.py), with
the same defaults. Skipped where scripts/install_vllm.sh has not run.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import vllm_env
from test_docs_readme import REPO, RUN, block, blocks

if not vllm_env.vllm_installed():
    pytest.skip("vllm not installed (scripts/install_vllm.sh)", allow_module_level=True)

DOC = "docs/integrations.md"
SERVE = ["vllm", "serve"]
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DOCUMENTED_ADDRESS = "unix:///run/kvserver/kvserver.sock"
SERVE_MODES = {"vllm-serve", "vllm-serve-dp", "vllm-serve-layerwise", "vllm-serve-events"}
# The kv-transfer-config every documented command gives, besides its extra config.
TRANSFER = {"kv_connector": "KVServerConnector", "kv_connector_module_path": "kvclient.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
SOURCES = sorted((REPO / "client" / "vllm").glob("*.py"))

# Run by `python -c` with VLLM_TARGET_DEVICE=cpu: reads [[name, argv], ...] on stdin, prints
# {name: parsed or error} on stdout, one parser per command (as `vllm` builds one per run).
PARSE = r"""
import contextlib, dataclasses, io, json, sys
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = {}
for name, argv in json.load(sys.stdin):
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    make_arg_parser(subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
            validate_parsed_serve_args(args)
    except SystemExit as exc:
        out[name] = {"error": f"exit {exc.code}: {err.getvalue()[-2000:]}"}
        continue
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    ktc = args.kv_transfer_config
    kve = getattr(args, "kv_events_config", None)
    mode = getattr(args.compilation_config, "cudagraph_mode", None)
    out[name] = {
        "subparser": args.subparser,
        "model_tag": args.model_tag,
        "data_parallel_size": args.data_parallel_size,
        "kv_transfer_config": None if ktc is None else dataclasses.asdict(ktc),
        "cudagraph_mode": None if mode is None else getattr(mode, "name", str(mode)),
        "kv_events_config": None if kve is None else dataclasses.asdict(kve),
    }
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.setup()
    yield
    vllm_env.restore()


def serve_commands(text: str) -> list[list[str]]:
    """The words of every `vllm serve` line of a block: continuations joined, split as bash splits them,
    leading VAR=value assignments skipped."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            words.pop(0)
        if words[:2] == SERVE:
            out.append(words)
    return out


def documented(mode: str) -> list[str]:
    (words,) = serve_commands(block(mode))
    return words


def parse_all(cases: dict[str, list[str]]) -> dict[str, dict]:
    """vLLM's parser on each `vllm serve ...` command (the words after `vllm`), in one subprocess."""
    for words in cases.values():
        assert words[:2] == SERVE, words
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    stdin = json.dumps([[name, words[1:]] for name, words in cases.items()])
    res = subprocess.run([sys.executable, "-c", PARSE], input=stdin, env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def with_json(words: list[str], flag: str, edit) -> list[str]:
    i = words.index(flag) + 1
    return [*words[:i], edit(words[i]), *words[i + 1:]]


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    """Every documented command as vLLM parsed it, and two broken ones."""
    base = documented("vllm-serve")
    cases = {mode: documented(mode) for mode in sorted(SERVE_MODES)}
    cases["malformed-json"] = with_json(base, "--kv-transfer-config", lambda s: s[:-1])
    cases["unknown-flag"] = [w.replace("--kv-transfer-config", "--kv-transfer-cfg") for w in base]
    cases["unknown-key"] = with_json(base, "--kv-transfer-config",
                                     lambda s: s.replace('"kv_role"', '"kv_rol"'))
    return parse_all(cases)


def ok(parsed: dict[str, dict], mode: str) -> dict:
    result = parsed[mode]
    assert "error" not in result, f"vLLM's parser refused {shlex.join(documented(mode))}:\n{result['error']}"
    return result


def transfer_config(result: dict):
    from vllm.config import KVTransferConfig

    d = result["kv_transfer_config"]
    init = {f.name for f in dataclasses.fields(KVTransferConfig) if f.init}
    return KVTransferConfig(**{k: v for k, v in d.items() if k in init})


# ---- every command parses -----------------------------------------------------------------------


def test_every_serve_command_is_run_here():
    doc_blocks = {key: text for key, text in blocks().items() if key[0] == DOC}
    serving = {key for key, text in doc_blocks.items() if serve_commands(text)}
    assert {RUN.get(key) for key in serving} == SERVE_MODES, "a `vllm serve` block not run here"
    for key in serving:
        assert len(serve_commands(doc_blocks[key])) == 1, key


@pytest.mark.parametrize("mode", sorted(SERVE_MODES))
def test_serve_command_parses_and_names_kvserver_connector(parsed, mode):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvclient.vllm.connector import KVServerConnector

    result = ok(parsed, mode)
    assert result["subparser"] == "serve" and result["model_tag"] == MODEL
    ktc = result["kv_transfer_config"]
    assert {k: ktc[k] for k in TRANSFER} == TRANSFER
    extra = ktc["kv_connector_extra_config"]
    assert extra["address"] == DOCUMENTED_ADDRESS
    # vLLM's factory, on the config it parsed, loads the connector from its module path.
    cls = KVConnectorFactory.get_connector_class(transfer_config(result))
    assert cls is KVServerConnector
    # By default vLLM keeps its full CUDA graphs; layer-by-layer waits (layerwise true) need
    # PIECEWISE ones, which vLLM then switches to.
    assert cls.requires_piecewise_for_cudagraph(extra) is (mode == "vllm-serve-layerwise")


def test_the_commands_differ_only_where_the_document_says(parsed):
    plain, dp, layerwise = (ok(parsed, m) for m in ("vllm-serve", "vllm-serve-dp", "vllm-serve-layerwise"))
    sizes = (plain["data_parallel_size"], dp["data_parallel_size"], layerwise["data_parallel_size"])
    assert sizes == (1, 2, 1)
    extras = [r["kv_transfer_config"]["kv_connector_extra_config"] for r in (plain, dp, layerwise)]
    assert extras[0] == extras[1] == {"address": DOCUMENTED_ADDRESS}
    assert extras[2] == {"address": DOCUMENTED_ADDRESS, "layerwise": True}
    assert layerwise["cudagraph_mode"] == "PIECEWISE"
    assert documented("vllm-serve-dp") == [*SERVE, MODEL, "--data-parallel-size", "2",
                                          *documented("vllm-serve")[3:]]
    # The events command: the plain one plus vLLM's own KV events, which the connector's feed
    # follows (its KV events reach the router through vLLM's publisher).
    events = ok(parsed, "vllm-serve-events")
    kve = events["kv_events_config"]
    assert kve["enable_kv_cache_events"] is True and kve["publisher"] == "zmq"
    assert kve["endpoint"] == "tcp://*:5557"
    same = [{k: v for k, v in r["kv_transfer_config"].items() if k != "engine_id"} for r in (events, plain)]
    assert same[0] == same[1]  # (engine_id: a new uuid at each parse)
    assert plain["kv_events_config"] is None or not plain["kv_events_config"]["enable_kv_cache_events"]


def test_a_malformed_json_or_unknown_flag_fails_the_parse(parsed):
    for case in ("malformed-json", "unknown-flag", "unknown-key"):
        assert "error" in parsed[case], f"vLLM's parser accepted the {case} command: {parsed[case]}"
    assert "Invalid JSON" in parsed["malformed-json"]["error"]
    assert "unrecognized arguments: --kv-transfer-cfg" in parsed["unknown-flag"]["error"]
    assert "kv_rol" in parsed["unknown-key"]["error"]


# ---- the extra config the document lists is the one the connector reads --------------------------


def documented_keys() -> dict[str, str]:
    """Section 4's table: key -> its default cell."""
    text = (REPO / DOC).read_text()
    section = text.split("### 4. `kv_connector_extra_config`", 1)[1].split("\n### ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            for key in re.findall(r"`(\w+)`", cells[0]):
                out[key] = cells[1]
    return out


def read_keys() -> dict[str, object]:
    """Every key client/vllm/*.py reads from the extra config: key -> its literal default (or None)."""
    out: dict[str, object] = {}
    for path in SOURCES:
        text = path.read_text()
        for m in re.finditer(r'cfg(?:\.get\(\s*"(\w+)"\s*(?:,\s*([^()]+?))?\)|\[\s*"(\w+)"\s*\])', text):
            key = m.group(1) or m.group(3)
            default = ast.literal_eval(m.group(2)) if m.group(2) else None
            if out.get(key) is None:
                out[key] = default
    return out


def test_documented_extra_config_keys_are_the_ones_the_connector_reads():
    doc, code = documented_keys(), read_keys()
    assert code, "no cfg.get(...) found in client/vllm"
    assert set(doc) == set(code), (f"documented, not read: {sorted(set(doc) - set(code))}; "
                                   f"read, not documented: {sorted(set(code) - set(doc))}")
    # A default the code spells as a literal is the one the table gives.
    for key, default in code.items():
        if default is None:
            continue
        cell = re.fullmatch(r"`([^`]+)`", doc[key])
        assert cell, f"{key}: the code's default is {default!r}, the document's {doc[key]!r}"
        assert json.loads(cell.group(1)) == default, (key, doc[key], default)
