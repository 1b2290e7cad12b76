"""Mutation testing of kvmesh's contracts and core state machines (``make mutation``; not in CI).

For each module below: copy the package and the tests into a scratch folder (default
``/tmp/kvmesh-mutation/<module>``, never the checkout), as the installed package is laid out
(the components' folders, engine/, router/, sidecar/, operator/, inside kvmesh/: setuptools'
package-dir mapping, which mutmut does not know), run mutmut 3 there with ONE worker
over that one file (or the listed functions of it) against only the fast unit tests that
cover it, then print the mutation score (killed / total) and every surviving mutant.

    .venv/bin/python bench/mutation.py                     # every module
    .venv/bin/python bench/mutation.py block_keys scoring  # some modules
    .venv/bin/python bench/mutation.py --list              # modules, files and tests
    .venv/bin/python bench/mutation.py --show scoring      # ... and the diff of each survivor
    .venv/bin/python bench/mutation.py --strict            # exit 2 if a survivor is not known equivalent

A mutant counts as killed when a test failed (or it timed out); "no tests" (no selected test
reaches the function) counts as a survivor. Mutants known to be equivalent are listed in
``docs/mutation.md`` with the reason, and in ``EQUIVALENT`` below, so the report can tell
them apart from the ones that still need a test: they stay in the score.

Hypothesis runs derandomized, without a database and without shrinking (a failing example
is enough to kill a mutant), so two runs over the same tree give the same score.

Needs the ``mutation`` extra: ``pip install -e '.[mutation]'``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: str) -> dict[str, str]:
    """Folder -> its place in the installed package, from pyproject's package-dir mapping
    (``{"engine": "kvmesh/engine", ...}``; a package not mapped sits where it is)."""
    mapping = tomllib.loads(pyproject).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {
        folder.strip("/"): name.replace(".", "/")
        for name, folder in mapping.items()
        if folder.strip("/")
    }


PACKAGE_DIRS = package_dirs((ROOT / "pyproject.toml").read_text())


def package_path(path: str, dirs: dict[str, str] = PACKAGE_DIRS) -> str:
    """A repository path as a path in the installed package: engine/scheduler.py ->
    kvmesh/engine/scheduler.py (what the tests import it as: kvmesh.engine.scheduler)."""
    for folder, place in dirs.items():
        if path.startswith(folder + "/"):
            return place + path[len(folder) :]
    return path


@dataclass
class Module:
    name: str
    path: str  # the file mutated, in the repository
    tests: list[str]  # pytest arguments selecting the fast tests that cover it
    functions: list[str] = field(default_factory=list)  # mutant-name globs (empty: the whole file)
    doc: str = ""

    @property
    def package_path(self) -> str:
        """The file in the work dir, laid out as the installed package."""
        return package_path(self.path)

    @property
    def dotted(self) -> str:
        return self.package_path[:-3].replace("/", ".")

    def globs(self) -> list[str]:
        # mutmut 3's mangled names: x_function, xǁClassǁmethod
        return [
            f"{self.dotted}.{f if f.startswith('xǁ') else 'x_' + f}__mutmut_*"
            for f in self.functions
        ]


def _nodes(path: str, *tests: str) -> list[str]:
    """Some tests of a file, by node id (a -k expression would also filter the other files)."""
    return [f"{path}::{t}" for t in tests]


def _m(cls: str, *methods: str) -> list[str]:
    """mutmut 3's mangled name of a method: ``xǁClassǁmethod``."""
    return [f"xǁ{cls}ǁ{m}" for m in methods]


MODULES = [
    Module(
        "block_keys",
        "kvmesh/common/block_keys.py",
        ["tests/test_block_keys.py", "tests/test_block_keys_mutants.py"],
        doc="contract 1: chained block keys",
    ),
    Module(
        "redis_layout",
        "kvmesh/common/redis_layout.py",
        [
            "tests/router/test_units.py::test_heartbeat_roundtrip_and_layout_names",
            "tests/router/test_units.py::test_prefix_match_lua_and_orphan_cleanup",
            "tests/router/test_redis_layout_mutants.py",
        ],
        doc="contract 3: Redis key names and the heartbeat hash (the Lua scripts are module "
        "constants: mutmut does not mutate them; test_units runs them on a real Redis)",
    ),
    Module(
        "kv_events_codec",
        "kvmesh/common/kv_events.py",
        [
            *_nodes(
                "tests/router/test_kv_events.py",
                "test_encoder_is_byte_identical_to_vllm_msgspec",
                "test_decoder_reads_vllm_bytes_with_bytes_hashes_and_dp_rank",
                "test_decoder_tolerates_missing_and_extra_trailing_fields",
                "test_decoder_refuses_wrong_types_with_the_one_error",
                "test_decoder_refuses_truncated_payloads",
                "test_validation_hook_failures_are_decode_errors",
            ),
            "tests/router/test_kv_events_fuzz.py",
            "tests/router/test_kv_events_codec_mutants.py",
        ],
        functions=[
            "encode_batch",
            "_short",
            "_is_int",
            "_hash",
            "_opt_hash",
            "_hashes",
            "_token_ids",
            "_opt_int",
            "_opt_str",
            "_opt",
            "_decode_event",
            "decode_batch",
            *_m("BlockStored", "to_wire"),
            *_m("BlockRemoved", "to_wire"),
            *_m("AllBlocksCleared", "to_wire"),
        ],
        doc="contract 2: the KV-event codec (not the ZMQ publisher/subscriber)",
    ),
    Module(
        "block_pool",
        "engine/block_pool.py",
        ["tests/engine/test_block_pool.py", "tests/engine/test_block_pool_mutants.py"],
        doc="free queue, reference counts, prefix cache, events",
    ),
    Module(
        "kv_cache_manager",
        "engine/kv_cache_manager.py",
        ["tests/engine/test_block_pool.py", "tests/engine/test_block_pool_mutants.py"],
        doc="block tables, prefix hits, slot allocation",
    ),
    Module(
        "scheduler",
        "engine/scheduler.py",
        ["tests/engine/test_scheduler.py", "tests/engine/test_scheduler_mutants.py"],
        doc="token-budget scheduler",
    ),
    Module(
        "scoring",
        "router/scoring.py",
        [
            *_nodes(
                "tests/router/test_units.py",
                "test_score_prefers_the_longest_prefix_then_load",
                "test_hotspot_guard_skips_a_far_hotter_pod_unless_all_are",
                "test_hotspot_guard_always_leaves_a_pod_in_front",
                "test_ties_break_deterministically_and_spread",
                "test_weights_parse",
            ),
            "tests/router/test_scoring_mutants.py",
        ],
        doc="contract 4: routing score, hotspot guard, tie-breaking",
    ),
    Module(
        "sidecar_index",
        "sidecar/index_writer.py",
        ["tests/sidecar/test_sidecar_index.py"],
        functions=[
            *_m("BlockIndex", "clear", "keys", "stored", "removed"),
            "_hashable",
            "validate_kvmesh_batch",
            *_m("IndexWriter", "apply", "incremental", "full_rewrite"),
        ],
        doc="the sidecar's index writer: events -> in-memory index -> the Redis block set",
    ),
    Module(
        "router_resume",
        "router/resume.py",
        ["tests/router/test_client_stream.py", "tests/router/test_resume_mutants.py"],
        doc="which requests the router resumes, their choices, the upstream and continuation bodies",
    ),
    Module(
        "sidecar_heartbeat",
        "sidecar/heartbeat.py",
        ["tests/sidecar/test_sidecar_heartbeat_counts.py"],
        functions=_m(
            "Heartbeat",
            "problem",
            "mark_draining",
            "beat",
            "_state_now",
            "_check_incarnation",
            "_engine_restarted",
        ),
        doc="the heartbeat's decisions, beat by beat (not its thread's loop and timing)",
    ),
    Module(
        "sidecar_health",
        "sidecar/health.py",
        ["tests/sidecar/test_sidecar_health.py"],
        doc="the sidecar's liveness and readiness, the probes' body, its metrics and their server",
    ),
    Module(
        "operator_scaling",
        "operator/scaling.py",
        [
            "tests/operator/test_scaling.py",
            "tests/operator/test_pod_phases.py",
            "tests/operator/test_scaling_mutants.py",
        ],
        functions=[
            "_parse_time",
            "engine_pods",
            "read_load",
            "observe",
            "deletion_costs",
            "annotate_deletion_costs",
        ],
        doc="the operator loop's view of pods and load, and the pods' deletion costs (not the "
        "kopf loop itself: tests/operator/test_operator_runtime.py drives it, too slowly per mutant)",
    ),
    Module(
        "supervisor",
        "kvmesh/mesh/supervisor.py",
        ["tests/mesh/test_supervisor.py"],
        doc="kvmesh up's restarts: the back-off, giving up, the exit statuses, a stopped child",
    ),
    Module(
        "resume_limits",
        "engine/model_limits.py",
        ["tests/engine/test_resume_mutants.py"],
        functions=_m("EngineLimits", "validate_resume", "check_token_ids"),
        doc="mid-stream resume: the checks on a continuation's ids (vocabulary, context, max_tokens)",
    ),
    Module(
        "resume_request",
        "engine/request.py",
        ["tests/engine/test_resume_mutants.py"],
        functions=_m(
            "Request",
            "__init__",
            "num_tokens",
            "num_output_tokens",
            "output_token_ids",
            "block_keys",
            "append_token",
            "check_stop",
        ),
        doc="mid-stream resume: the request a continuation becomes, its output counted from the "
        "resumed ids on (not RequestStatus)",
    ),
    Module(
        "resume_choices",
        "engine/server/choices.py",
        ["tests/engine/test_resume_mutants.py"],
        functions=["validate_resume"],
        doc="mid-stream resume: a continued choice checked, its errors naming its resume.choices entry",
    ),
    Module(
        "resume_body",
        "engine/server/protocol.py",
        ["tests/engine/test_resume_mutants.py"],
        functions=_m("_Generation", "resume_token_ids", "resume_choices"),
        doc="mid-stream resume: the request body's two forms (output_token_ids, choices)",
    ),
    Module(
        "structured_rows",
        "engine/structured/bitmask.py",
        [
            "tests/engine/structured/test_spec_masks.py",
            "tests/engine/structured/test_structured_mutants.py",
        ],
        doc="structured outputs: which logits rows get which grammar's mask (speculation: one "
        "row per draft position), the mask applied to those rows only",
    ),
    Module(
        "structured_grammar",
        "engine/structured/backend.py",
        [
            "tests/engine/structured/test_spec_masks.py",
            "tests/engine/structured/test_structured_mutants.py",
        ],
        functions=_m("RequestGrammar", "__init__", "compiling", "poll", "accept", "done", "synced"),
        doc="structured outputs: a request's grammar while it compiles and after, refused and "
        "synced to its outputs (not the backend's compile and cache)",
    ),
    Module(
        "structured_state",
        "engine/structured/matcher.py",
        [
            "tests/engine/structured/test_spec_masks.py",
            "tests/engine/structured/test_structured_mutants.py",
        ],
        doc="structured outputs: the matcher state's counts through accept, validate, rollback, reset",
    ),
    Module(
        "tool_choice",
        "engine/server/tool_choice.py",
        [
            "tests/engine/server/test_tool_plan.py",
            "tests/engine/server/test_tool_choice_mutants.py",
        ],
        doc="tool calling: the mode a request asks for, its output schema, its parser",
    ),
]
BY_NAME = {m.name: m for m in MODULES}

# Mutants judged equivalent (no test can tell them from the original); the reasons are in
# docs/mutation.md. They count as survivors in the score and are marked "(equivalent)".
# (Mutant numbers follow the source: after an edit of a module, check its entries again.)
EQUIVALENT: dict[str, set[str]] = {
    "redis_layout": {"xǁHeartbeatǁfrom_mapping__mutmut_13", "xǁHeartbeatǁfrom_mapping__mutmut_15"},
    "kv_events_codec": {
        "x_decode_batch__mutmut_3",
        "x_decode_batch__mutmut_4",
        "x_decode_batch__mutmut_6",
        "x_decode_batch__mutmut_31",
        "x_decode_batch__mutmut_32",
        "x_encode_batch__mutmut_9",
    },
    "scoring": {"x_check_hotspot_params__mutmut_8", "x_rendezvous__mutmut_4"},
    "block_pool": {
        "xǁBlockPoolǁ__init____mutmut_1",
        "xǁBlockPoolǁ__init____mutmut_10",
        *(f"xǁFreeBlockQueueǁ__init____mutmut_{i}" for i in (2, 3, 4, 6, 7, 8)),
        "xǁFreeBlockQueueǁremove__mutmut_1",
        "xǁKVBlockǁ__init____mutmut_6",
        "xǁKVBlockǁ__init____mutmut_7",
    },
    "kv_cache_manager": {
        "xǁKVCacheManagerǁ__init____mutmut_7",
        "xǁKVCacheManagerǁ_cache_full_blocks__mutmut_9",
    },
    "sidecar_index": {
        "xǁBlockIndexǁstored__mutmut_21",
        "xǁBlockIndexǁstored__mutmut_35",
        "xǁIndexWriterǁfull_rewrite__mutmut_8",
        "xǁIndexWriterǁfull_rewrite__mutmut_9",
        "xǁIndexWriterǁfull_rewrite__mutmut_23",
        "xǁIndexWriterǁincremental__mutmut_2",
        "xǁIndexWriterǁincremental__mutmut_3",
    },
    "scheduler": {"xǁSchedulerǁschedule__mutmut_7", "xǁSchedulerǁschedule__mutmut_36"},
    "sidecar_heartbeat": {"xǁHeartbeatǁbeat__mutmut_44"},
    "resume_choices": {"x_validate_resume__mutmut_29"},
    "structured_grammar": {"xǁRequestGrammarǁ__init____mutmut_4"},
    "structured_rows": {
        *(f"x_apply__mutmut_{i}" for i in (7, 31, 32, 41, 43, 46, 48, 52)),
        "x_apply_numpy__mutmut_11",
        "x_for_step__mutmut_32",
    },
    "supervisor": {f"xǁChildǁstart__mutmut_{i}" for i in (1, 11, 13, 20, 22, 24, 27)},
    "sidecar_health": {
        "x_metrics_registry__mutmut_2",
        "x_metrics_registry__mutmut_3",
        *(f"xǁHealthServerǁ_handler__mutmut_{i}" for i in (6, 9, 80, 81, 87, 88)),
    },
}

PLUGIN = '''\
"""Loaded by bench/mutation.py's pytest runs: deterministic Hypothesis, no shrinking."""
from hypothesis import Phase, settings

settings.register_profile("kvmesh-mutation", derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate), print_blob=False)
settings.load_profile("kvmesh-mutation")
'''

KILLED = {"killed", "timeout", "caught by type check"}


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def prepare(mod: Module, workdir: Path, rev: str | None = None) -> None:
    """A fresh copy of the package and the tests, with this module's mutmut config. The copy is
    laid out as the installed package (the mapped folders moved into kvmesh/), so mutmut's
    file-path names of the mutants are the module names the tests import."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    if rev:  # a commit, not the working tree (others' uncommitted edits stay out)
        pyproject = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:pyproject.toml"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        dirs = package_dirs(pyproject)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "kvmesh", "tests", *dirs],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(
            ["tar", "-x", "-C", str(workdir), "--exclude=tests/operator/golden"],
            input=archive,
            check=True,
        )
        for folder, place in dirs.items():
            shutil.move(workdir / folder, workdir / place)
    else:
        pyproject = (ROOT / "pyproject.toml").read_text()
        dirs = PACKAGE_DIRS
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "golden")
        shutil.copytree(ROOT / "kvmesh", workdir / "kvmesh", ignore=ignore)
        for folder, place in dirs.items():
            shutil.copytree(ROOT / folder, workdir / place, ignore=ignore)
        shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    target = package_path(mod.path, dirs)
    if not (workdir / target).is_file():
        raise SystemExit(f"{mod.name}: {mod.path} is not in the copy ({target})")
    (workdir / "_kvmesh_mutation_plugin.py").write_text(PLUGIN)
    # A test file not there (yet) is left out rather than failing the run.
    tests = [
        t
        for t in mod.tests
        if t.startswith("-") or (workdir / t.split("::")[0]).exists() or not t.startswith("tests/")
    ]
    if not any(t.startswith("tests/") for t in tests):
        raise SystemExit(f"{mod.name}: none of its test files exist ({mod.tests})")
    pyproject += f"""
[tool.mutmut]
source_paths = ["kvmesh"]
only_mutate = [{json.dumps(target)}]
pytest_add_cli_args_test_selection = {_toml_list(tests)}
pytest_add_cli_args = ["-p", "_kvmesh_mutation_plugin", "-p", "no:cacheprovider", "-W", "ignore"]
also_copy = ["_kvmesh_mutation_plugin.py"]
use_git_change_detection = false
timeout_multiplier = 10.0
"""
    (workdir / "pyproject.toml").write_text(pyproject)


def run_module(mod: Module, workdir: Path, log) -> int:
    cmd = [
        str(Path(sys.executable).with_name("mutmut")),
        "run",
        "--max-children",
        "1",
        *mod.globs(),
    ]
    # mutmut forks a child per mutant: torch's OpenMP pool, started by an earlier test in the
    # parent, deadlocks in the child at the next large tensor op (a timeout, counted as killed)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", MUTANT_UNDER_TEST="", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env
    ).returncode


def results(mod: Module, workdir: Path) -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    meta = workdir / "mutants" / (mod.package_path + ".meta")
    if not meta.exists():
        return {}
    data = json.loads(meta.read_text())["exit_code_by_key"]
    globs = mod.globs()
    return {
        name: status_by_exit_code[code]
        for name, code in sorted(data.items())
        if not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)
    }


def diff(workdir: Path, name: str) -> str:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("mutmut")), "show", name],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def short(mod: Module, name: str) -> str:
    return name[len(mod.dotted) + 1 :] if name.startswith(mod.dotted + ".") else name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"some of: {', '.join(BY_NAME)} (default: all)")
    ap.add_argument(
        "--workdir",
        default=os.environ.get("KVMESH_MUTATION_DIR", "/tmp/kvmesh-mutation"),
        help="scratch folder (a subfolder per module; removed and rebuilt each run)",
    )
    ap.add_argument("--show", action="store_true", help="print the diff of every survivor")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--list", action="store_true", help="list the modules, their files and tests")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when a survivor is not listed as equivalent (a test is missing)",
    )
    ap.add_argument(
        "--rev", help="mutate and test this commit (git archive) instead of the working tree"
    )
    ap.add_argument(
        "--tests", help="pytest arguments replacing the module's test selection (one module)"
    )
    args = ap.parse_args(argv)

    unknown = [m for m in args.modules if m not in BY_NAME]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; expected some of {list(BY_NAME)}")
    mods = [BY_NAME[m] for m in args.modules] or MODULES
    if args.tests:
        if len(mods) != 1:
            ap.error("--tests needs exactly one module")
        mods = [
            Module(
                mods[0].name, mods[0].path, shlex.split(args.tests), mods[0].functions, mods[0].doc
            )
        ]
    if args.list:
        for m in mods:
            print(
                f"{m.name:18} {m.path}{' (' + ', '.join(m.functions) + ')' if m.functions else ''}\n"
                f"{'':18} tests: {' '.join(m.tests)}\n{'':18} {m.doc}"
            )
        return 0

    table = []
    report: dict[str, dict] = {}
    failed = False
    for mod in mods:
        workdir = Path(args.workdir) / mod.name
        prepare(mod, workdir, args.rev)
        t0 = time.monotonic()
        print(f"== {mod.name}: {mod.path} (log: {workdir / 'mutmut.log'})", flush=True)
        with open(workdir / "mutmut.log", "w") as log:
            rc = run_module(mod, workdir, log)
        res = results(mod, workdir)
        elapsed = time.monotonic() - t0
        if rc != 0 or not res:
            failed = True
            print(f"   mutmut failed (exit {rc}); the end of its log:")
            print("".join(open(workdir / "mutmut.log", errors="replace").readlines()[-30:]))
        killed = sum(1 for s in res.values() if s in KILLED)
        survivors = {n: s for n, s in res.items() if s not in KILLED}
        equivalent = EQUIVALENT.get(mod.name, set())
        score = killed / len(res) if res else 0.0
        n_equivalent = sum(1 for n in survivors if short(mod, n) in equivalent)
        table.append((mod.name, killed, len(res), n_equivalent, score, elapsed))
        print(f"   {killed}/{len(res)} killed ({100 * score:.1f}%) in {elapsed:.0f}s")
        for name, status in survivors.items():
            tag = " (equivalent)" if short(mod, name) in equivalent else ""
            print(f"   {status:10} {short(mod, name)}{tag}")
            if args.show:
                print("      " + diff(workdir, name).replace("\n", "\n      "))
        report[mod.name] = {"path": mod.path, "killed": killed, "total": len(res), "results": res}

    print()
    print("| module | file | killed / total | score | survivors | of which equivalent |")
    print("|---|---|---|---|---|---|")
    for (name, killed, total, n_eq, score, _), mod in zip(table, mods):
        print(
            f"| {name} | {mod.path} | {killed} / {total} | {100 * score:.1f}% | {total - killed} | {n_eq} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    unexplained = sum(total - killed - n_eq for _, killed, total, n_eq, _, _ in table)
    if unexplained:
        print(
            f"\n{unexplained} survivor(s) not known to be equivalent: kill them with a test, or list them "
            "in EQUIVALENT and docs/mutation.md with the reason"
        )
    if failed:
        return 1
    return 2 if args.strict and unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
