"""The `megajax` command.

    megajax train [--config FILE ...] [key.sub=value ...]
    megajax preprocess --input FILE [FILE ...] --tokenizer TOK --output-prefix P [...]
    megajax preprocess --merge P1 P2 [...] --output-prefix P
    megajax export --format hf|megatron --checkpoint DIR --output DIR [--tokenizer TOK]
    megajax import --format hf|megatron --input DIR --output DIR
    megajax bench [--config FILE ...] [key.sub=value ...] [--json FILE] [--baseline torch|megatron]
                  [--sweep key=v1,v2,...] [--topology 8xH100]

A user error (bad config, mesh, file) prints one paragraph on stderr and
exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from megajax.errors import UserError

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _simulate_cpu_devices(count: int) -> None:
    """Asks XLA for `count` host devices, unless the caller already chose a count."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 0 and DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config (path, or a name under configs/ such as model/llama3-8b); "
                        "repeatable, later files override earlier ones")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=100 mesh.tensor=4")


def cmd_train(args: argparse.Namespace) -> int:
    from megajax.config import load_config
    cfg = load_config(args.config, args.overrides)
    _simulate_cpu_devices(cfg.mesh.cpu_devices)
    from megajax import distributed
    plan = distributed.plan_processes(cfg.distributed)
    if plan is not None and not os.environ.get(distributed.SUPERVISED_ENV):
        if not cfg.train.run_dir:
            distributed.initialize(cfg)  # raises the error naming train.run_dir
        return distributed.supervise(args.argv, plan, cfg.distributed, cfg.train.run_dir)
    distributed.initialize(cfg)  # a multi-process run joins the runtime before JAX touches a device
    from megajax.train.loop import train
    result = train(cfg)
    return 130 if result.stopped_by == "SIGINT" else 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    if bool(args.input) == bool(args.merge):
        raise UserError("megajax preprocess needs either --input FILE [FILE ...] (tokenize text) or "
                        "--merge P1 P2 [...] (concatenate datasets), not both and not neither.")
    if args.merge:
        from megajax.data.indexed import merge
        out = merge(args.merge, args.output_prefix)
        print(f"wrote {args.output_prefix}.{{bin,idx}}: {out.num_documents} documents, "
              f"{out.num_tokens} tokens ({out.dtype.name}) from {len(args.merge)} datasets", file=sys.stderr)
        return 0
    if not args.tokenizer:
        raise UserError("megajax preprocess --input needs --tokenizer: 'byte', a Hugging Face "
                        "tokenizer.json, or a directory containing one.")
    from megajax.data.preprocess import preprocess
    s = preprocess(args.input, args.json_keys, args.tokenizer, args.output_prefix,
                   append_eod=args.append_eod, workers=args.workers, input_format=args.input_format,
                   errors=args.errors)
    mb = s.input_bytes / 1e6
    for key, prefix in s.prefixes.items():
        print(f"wrote {prefix}.{{bin,idx}}: {s.documents} documents, {s.tokens[key]} tokens ({s.dtype})",
              file=sys.stderr)
    print(f"{mb:.1f} MB in {s.seconds:.1f} s ({mb / max(s.seconds, 1e-9):.1f} MB/s, "
          f"{s.documents / max(s.seconds, 1e-9):,.0f} docs/s)", file=sys.stderr)
    return 0


def _add_preprocess_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", default=[], metavar="FILE",
                   help="jsonl or plain-text files (optionally .gz), concatenated in order")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSON fields to tokenize, one dataset each (default: text)")
    p.add_argument("--tokenizer", metavar="TOK",
                   help="'byte', a Hugging Face tokenizer.json, or a directory containing one")
    p.add_argument("--output-prefix", required=True, metavar="P",
                   help="writes P_KEY_document.{bin,idx} (with --merge: P.{bin,idx})")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-document id")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1)")
    p.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "lines", "files"),
                   help="jsonl; lines: one document per line; files: one document per file; "
                        "auto: jsonl for *.jsonl/*.json, else lines")
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="bytes that are not UTF-8: strict (stop, naming the file and line; default) or "
                        "replace (substitute U+FFFD)")
    p.add_argument("--merge", nargs="+", default=[], metavar="P",
                   help="instead of tokenizing, concatenate these dataset prefixes into --output-prefix")


def _export_tokenizer(args: argparse.Namespace, meta: dict, step_dir: Path) -> str:
    """--tokenizer, else the checkpoint's data.tokenizer; an error suggesting --tokenizer if it is not here."""
    from megajax.data.tokenizer import load_tokenizer
    from megajax.errors import CheckpointError, ConfigError
    spec = args.tokenizer or meta["config"].get("data", {}).get("tokenizer", "byte")
    try:
        load_tokenizer(spec, key="--tokenizer")
    except ConfigError:
        if args.tokenizer:
            raise
        raise CheckpointError(f"checkpoint {step_dir} was trained with data.tokenizer = {spec!r}, which is not "
                              f"found from {os.getcwd()}; pass --tokenizer TOK naming that tokenizer ('byte', a "
                              f"Hugging Face tokenizer.json, or a directory containing one).") from None
    return spec


def cmd_export(args: argparse.Namespace) -> int:
    from megajax.checkpoint.manager import CheckpointSource, read_meta
    source = CheckpointSource(args.checkpoint)
    meta = read_meta(source.step_dir)
    tokenizer = _export_tokenizer(args, meta, source.step_dir)
    if args.format == "hf":
        from megajax.checkpoint.hf import export_hf
        out = export_hf(source, args.output, tokenizer_spec=tokenizer, dtype=args.dtype)
    else:
        from megajax.checkpoint.megatron import export_megatron
        step = int(meta.get("step", 0))
        out = export_megatron(source, args.output, tensor_parallel=args.tensor_parallel,
                              pipeline_parallel=args.pipeline_parallel, dtype=args.dtype,
                              iteration=step if step >= 1 else None, tokenizer_spec=tokenizer)
    print(f"megajax export: {source.step_dir} -> {out} ({args.format}, {args.dtype}, tokenizer {tokenizer})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from megajax.checkpoint.common import imported_tokenizer
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    if args.format == "hf":
        from megajax.checkpoint.hf import hf_tokenizer, import_hf
        overrides, params = import_hf(args.input)
        found, known = hf_tokenizer(args.input)
    else:
        from megajax.checkpoint.megatron import import_megatron, megatron_tokenizer
        overrides, params = import_megatron(args.input)
        found, known = megatron_tokenizer(args.input)
    tokenizer, warning = imported_tokenizer(found, overrides["vocab_size"], known)
    base = {"model": overrides, "data": {"tokenizer": tokenizer}}
    if overrides.get("max_position_embeddings"):
        base["train"] = {"seq_len": min(overrides["max_position_embeddings"], 2048)}
    cfg = load_config(base=base)
    step_dir = write_params_checkpoint(params, cfg, args.output)
    print(f"megajax import: {args.input} -> {step_dir} (tokenizer {tokenizer}); fine-tune with "
          f"checkpoint.load={args.output} and the same model.* settings (saved in its meta).")
    if warning:
        print(f"megajax import: warning: {warning}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from megajax.config import load_config
    cfg = load_config(args.config, args.overrides)
    if args.topology:
        from megajax.perf.bench import format_topology, topology_estimate, write_json
        report = topology_estimate(cfg, args.topology)
        print(format_topology(report))
        if args.json:
            write_json(report, args.json)
        return 0
    _simulate_cpu_devices(cfg.mesh.cpu_devices)
    from megajax.perf import bench
    kw = dict(steps=args.steps, warmup=args.warmup, baseline=args.baseline)
    if args.sweep:
        key, values = bench.parse_sweep(args.sweep)
        points = bench.sweep(args.config, args.overrides, key, values, **kw)
        for p in points:
            print(f"--- {key}={p['sweep']['value']}")
            print(bench.format_report(p))
        print()
        print(bench.format_sweep(points))
        plot = Path(args.plot) if args.plot else Path(args.json or "bench.json").with_suffix(".png")
        written = bench.plot_sweep(points, plot)
        print(f"plot: {written}" if written else "plot: skipped (matplotlib is not installed; "
              "pip install 'megajax[bench]')")
        report = {"sweep": {"key": key, "values": values}, "points": points}
    else:
        report = bench.bench_one(cfg, **kw)
        print(bench.format_report(report))
    if args.json:
        bench.write_json(report, args.json)
        print(f"json: {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megajax", description="Megatron-style LLM training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(subparsers=sub.choices)
    p = sub.add_parser("train", help="train a model (no arguments: a small model on an embedded corpus)")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("preprocess", help="tokenize text into a Megatron dataset (.bin/.idx), or merge datasets")
    _add_preprocess_args(p)
    p.set_defaults(func=cmd_preprocess)
    p = sub.add_parser("export", help="write a checkpoint as Hugging Face or Megatron-Core files")
    p.add_argument("--format", choices=("hf", "megatron"), required=True)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run directory (its latest checkpoint) or one step's directory")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="megatron: split for this TP size")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="N", help="megatron: split into N stages")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--tokenizer", metavar="TOK", help="the tokenizer the export carries ('byte', a Hugging Face "
                                                     "tokenizer.json or its directory); default: the checkpoint's")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="turn Hugging Face or Megatron-Core weights into a megajax checkpoint")
    p.add_argument("--format", choices=("hf", "megatron"), required=True)
    p.add_argument("--input", required=True, metavar="DIR")
    p.add_argument("--output", required=True, metavar="DIR")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser("bench", help="time, memory and communication of a config's train step")
    _add_config_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--steps", type=int, default=10, help="timed steps after warm-up (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--baseline", choices=("torch", "megatron"),
                   help="time the same model as a PyTorch training step (Hugging Face transformers, or "
                        "Megatron-Core's GPTModel on a GPU), interleaved with megajax's")
    p.add_argument("--sweep", metavar="key=v1,v2,...", help="repeat over the values of one config key "
                                                           "and plot time and memory against it")
    p.add_argument("--plot", metavar="FILE.png", help="where the sweep's plot goes (default: beside --json)")
    p.add_argument("--topology", metavar="NxKIND", help="estimate per-device memory on N devices of KIND "
                                                       "(e.g. 8xH100) and say whether the config fits")
    p.set_defaults(func=cmd_bench)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options and key=value overrides in any order, in every subcommand
    (`megajax train train.steps=1 --config model/tiny train.seq_len=64`)."""
    parser = build_parser()
    commands = parser.get_default("subparsers")
    if argv and argv[0] in commands:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # no or unknown command: argparse's usage and error


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except UserError as e:
        message = re.sub(r"\s+", " ", str(e)).strip()
        print(f"megajax {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megajax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
