"""The `megajax` command.

    megajax train [--config FILE ...] [key.sub=value ...]
    megajax preprocess [--format indexed] --input FILE [FILE ...] --tokenizer TOK --output-prefix P [...]
    megajax preprocess --merge P1 P2 [...] --output-prefix P
    megajax preprocess --format webdataset --images DIR --captions FILE.jsonl --output-dir DIR [--shard-size N]
    megajax export --format hf|megatron|peft --checkpoint DIR --output DIR [--merge-lora] [--tokenizer TOK]
        [--with-optimizer] [--expert-parallel N] [--expert-tensor-parallel N] [--trust-checkpoint]
        [checkpoint.step=N]
        (DIR: a megajax run or step, or a Megatron save / iter_ directory, legacy or torch_dist)
    megajax import --format hf|megatron|peft --input DIR --output DIR [--base DIR] [--trust-checkpoint]
    megajax bench [--config FILE ...] [key.sub=value ...] [--json FILE] [--baseline torch|megatron]
                  [--sweep key=v1,v2,...] [--topology 8xH100] [--gemm-table FILE.yaml]
    megajax generate --checkpoint DIR | --hf DIR [--adapter DIR] [--image FILE] --prompt TEXT [...] | --prompts-file F
                     [--chat] [--chat-template FILE] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json FILE]
    megajax serve --checkpoint DIR | --hf DIR [--adapter DIR] [--host H] [--port P] [--max-batch N] [--drain-timeout S]
                  [--batching continuous|static] [--block-size N] [--num-kv-blocks N] [--prefill-chunk N]
                  [--prefill-rows N] [--enable-prefix-caching | --no-enable-prefix-caching]
                  [--limit-images-per-prompt N] [--allowed-local-media-path DIR]
    megajax config from-megatron [--world-size N] -- ARGS...   (a Megatron-LM pretrain_gpt.py argument list)

A user error (bad config, mesh, file) prints one paragraph on stderr and
exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

from megajax.errors import ConfigError, UserError
from megajax.paths import check_outputs as _check_outputs
from megajax.paths import removed_on_failure
from megajax.xla_env import prepare as _prepare_xla  # before JAX starts: XLA reads XLA_FLAGS once


TRUST_HELP = ("a Megatron checkpoint's files are read without running code they name (Megatron's classes as "
              "stand-ins, other classes refused); this option unpickles them with Python's full pickle instead, "
              "which runs whatever code a file names: only for a checkpoint whose origin you trust")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config (path, or a name under configs/ such as model/llama3-8b); "
                        "repeatable, later files override earlier ones")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=100 mesh.tensor=4")


def cmd_train(args: argparse.Namespace) -> int:
    from megajax.train.stop_signals import exit_status
    try:
        return _train(args)
    except KeyboardInterrupt as e:  # a signal before the run's own handlers (megajax/train/stop_signals.py)
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(f"megajax: {name} received during start-up, before the first step: stopped; nothing to save.",
              flush=True)
        return exit_status(name)


def _tensor_overlap(cfg) -> bool:
    """Whether the run overlaps tensor-parallel collectives (parallel.tp_comm_overlap with mesh.tensor
    other than 1): megajax.xla_env then sets XLA's options for it where a GPU may run."""
    return cfg.parallel.tp_comm_overlap and cfg.mesh.tensor * cfg.mesh.dcn.tensor != 1


def _train(args: argparse.Namespace) -> int:
    from megajax.checkpoint.stored_model import train_config  # checkpoint.load's model under the keys set
    notes: list[str] = []
    cfg = train_config(args.config, args.overrides, notes)
    for note in notes:
        print(f"megajax train: {note}", flush=True)  # with the run's log (stdout): stderr is for errors
    _prepare_xla(cfg.mesh.cpu_devices, tensor_overlap=_tensor_overlap(cfg))
    from megajax import compile_cache, distributed
    compile_cache.enable(cfg.ops.compile_cache)  # before the first compile
    plan = distributed.plan_processes(cfg.distributed)
    if plan is not None and not os.environ.get(distributed.SUPERVISED_ENV):
        if not cfg.train.run_dir:
            distributed.initialize(cfg)  # raises the error naming train.run_dir
        return distributed.supervise(args.argv, plan, cfg.distributed, cfg.train.run_dir)
    distributed.initialize(cfg)  # a multi-process run joins the runtime before JAX touches a device
    from megajax.train.stop_signals import exit_status
    return exit_status(run_training(cfg).stopped_by)


def run_training(cfg, devices: list | None = None):
    """What `megajax train` runs: the training loop with the memory fit check before the first step
    (megajax.perf.fit.fit_check), the exact-match accuracy before and after (train.exact_match_prompts,
    megajax.inference.exact_match) and the sample at the end (megajax.inference.text); the
    loop's package imports neither, they are handed to it here."""
    from megajax.inference.exact_match import exact_match_hook
    from megajax.inference.text import training_sample
    from megajax.perf.fit import fit_check
    from megajax.train.loop import train
    return train(cfg, devices, check_compiled=fit_check, on_start=[exact_match_hook("before")],
                 on_end=[exact_match_hook("after"), training_sample])


TEXT_PREPROCESS_DEFAULTS = {"json_keys": ["text"], "workers": 1, "input_format": "auto", "errors": "strict"}


def cmd_preprocess(args: argparse.Namespace) -> int:
    if args.format == "webdataset":
        return _preprocess_webdataset(args)
    if args.images or args.captions or args.output_dir:
        raise UserError("megajax preprocess: --images, --captions and --output-dir write image-text shards; "
                        "add --format webdataset.")
    if args.shard_size is not None:
        raise UserError(f"--shard-size {args.shard_size} sets the samples per image-text shard (--format "
                        f"webdataset); a text dataset is one .bin/.idx pair: drop it.")
    tokenizing = [f"--{k.replace('_', '-')}" for k in ("tokenizer", *TEXT_PREPROCESS_DEFAULTS) if getattr(args, k) is not None]
    tokenizing += ["--append-eod"] if args.append_eod else []
    if args.merge and tokenizing:  # --merge concatenates token ids already written
        raise UserError(f"{', '.join(tokenizing)} with --merge: --merge concatenates datasets already tokenized, and "
                        f"{'these options tokenize' if len(tokenizing) > 1 else 'this option tokenizes'} --input text; "
                        f"drop {'them' if len(tokenizing) > 1 else 'it'}.")
    for key, value in TEXT_PREPROCESS_DEFAULTS.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if not args.output_prefix:
        raise UserError("megajax preprocess needs --output-prefix P (the dataset files written: P_KEY_document.bin/.idx, "
                        "or P.bin/.idx with --merge).")
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


def _preprocess_webdataset(args: argparse.Namespace) -> int:
    """Image-text shards from a folder of images and a jsonl of their captions (megajax/data/webdataset.py)."""
    if args.input or args.merge or args.output_prefix:
        raise UserError("megajax preprocess --format webdataset reads --images DIR and --captions FILE.jsonl and "
                        "writes --output-dir DIR; --input, --merge and --output-prefix are for text datasets.")
    text_only = [f"--{k.replace('_', '-')}" for k in ("tokenizer", *TEXT_PREPROCESS_DEFAULTS) if getattr(args, k) is not None]
    text_only += ["--append-eod"] if args.append_eod else []
    if text_only:  # the shards hold the images and the text as given: tokenized when a run reads them
        raise UserError(f"{', '.join(text_only)}: {'options' if len(text_only) > 1 else 'an option'} of text "
                        f"datasets; --format webdataset writes the images and their text untokenized (a run "
                        f"tokenizes them with its data.tokenizer): drop {'them' if len(text_only) > 1 else 'it'}.")
    args.shard_size = 1000 if args.shard_size is None else args.shard_size
    missing = [f for f, v in (("--images", args.images), ("--captions", args.captions),
                              ("--output-dir", args.output_dir)) if not v]
    if missing:
        raise UserError(f"megajax preprocess --format webdataset needs {', '.join(missing)} (--images: the folder of "
                        f"pictures; --captions: a jsonl of {{\"image\": FILE, \"caption\": TEXT}} lines; "
                        f"--output-dir: where the .tar shards go).")
    if args.shard_size <= 0:
        raise UserError(f"--shard-size = {args.shard_size}: must be > 0 (samples per shard).")
    import time
    from megajax.data.webdataset import preprocess_images
    start = time.perf_counter()
    shards, count = preprocess_images(args.images, args.captions, args.output_dir, shard_size=args.shard_size)
    seconds = time.perf_counter() - start
    print(f"wrote {len(shards)} shard{'s' if len(shards) > 1 else ''} of {count} image-text samples to "
          f"{args.output_dir} in {seconds:.1f} s ({count / max(seconds, 1e-9):,.0f} samples/s); train on them "
          f"with data.format=webdataset data.path={args.output_dir}", file=sys.stderr)
    return 0


def _add_preprocess_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="indexed", choices=("indexed", "webdataset"),
                   help="indexed: tokenize text into a Megatron .bin/.idx dataset (default); webdataset: write "
                        "image-text tar shards from --images and --captions")
    p.add_argument("--input", nargs="+", default=[], metavar="FILE",
                   help="jsonl or plain-text files (optionally .gz), concatenated in order")
    p.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                   help="JSON fields to tokenize, one dataset each (default: text)")
    p.add_argument("--tokenizer", metavar="TOK",
                   help="'byte', a Hugging Face tokenizer.json, or a directory containing one")
    p.add_argument("--output-prefix", metavar="P",
                   help="writes P_KEY_document.{bin,idx} (with --merge: P.{bin,idx})")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the tokenizer's end-of-document id")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="tokenizer processes (default 1)")
    p.add_argument("--input-format", default=None, choices=("auto", "jsonl", "lines", "files"),
                   help="jsonl; lines: one document per line; files: one document per file; "
                        "auto: jsonl for *.jsonl/*.json, else lines")
    p.add_argument("--errors", default=None, choices=("strict", "replace"),
                   help="bytes that are not UTF-8: strict (stop, naming the file and line; default) or "
                        "replace (substitute U+FFFD)")
    p.add_argument("--merge", nargs="+", default=[], metavar="P",
                   help="instead of tokenizing, concatenate these dataset prefixes into --output-prefix")
    p.add_argument("--images", metavar="DIR", help="--format webdataset: the folder of the pictures")
    p.add_argument("--captions", metavar="FILE",
                   help="--format webdataset: jsonl lines {\"image\": path in --images, \"caption\": text} (or "
                        "\"messages\": a conversation with an <image> marker)")
    p.add_argument("--output-dir", metavar="DIR", help="--format webdataset: where the shards are written")
    p.add_argument("--shard-size", type=int, default=None, metavar="N",
                   help="--format webdataset: samples per .tar shard (default 1000)")


def _export_tokenizer(args: argparse.Namespace, meta: dict, step_dir: Path, required: bool = True) -> str | None:
    """--tokenizer, else the checkpoint's data.tokenizer; an error suggesting --tokenizer if it is not here
    (None instead where not `required`)."""
    from megajax.data.no_tokenizer import is_no_tokenizer
    from megajax.data.tokenizer import load_tokenizer
    from megajax.errors import CheckpointError, ConfigError
    spec = args.tokenizer or meta["config"].get("data", {}).get("tokenizer", "byte")
    if is_no_tokenizer(spec):  # trained without a tokenizer (an import of a NullTokenizer run): none to carry
        return spec
    try:
        load_tokenizer(spec, key="--tokenizer")
    except ConfigError:
        if args.tokenizer:
            raise
        if not required:
            return None
        raise CheckpointError(f"checkpoint {step_dir} was trained with data.tokenizer = {spec!r}, which is not "
                              f"found from {os.getcwd()}; pass --tokenizer TOK naming that tokenizer ('byte', a "
                              f"Hugging Face tokenizer.json, or a directory containing one).") from None
    return spec


def _checkpoint_step(overrides: list[str], accept_only: bool = False) -> int | None:
    """checkpoint.step=N among the key=value overrides of export, generate and serve (None: latest).
    `accept_only`: no other key is accepted (export reads nothing else from the config)."""
    from megajax.config import CheckpointConfig, _build, _deep_merge, parse_override
    merged: dict = {}
    for o in overrides:
        merged = _deep_merge(merged, parse_override(o))

    def keys(tree: dict, prefix: str = "") -> list[str]:
        return [k for name, v in tree.items()
                for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict) else [f"{prefix}{name}"])]
    others = [k for k in keys(merged) if k != "checkpoint.step"]
    if accept_only and others:
        raise UserError(f"megajax export: {', '.join(others)}: not an option of export; the only key=value it "
                        f"accepts is checkpoint.step=N (a step other than the latest).")
    section = merged.get("checkpoint")
    step = _build(CheckpointConfig, {"step": section.get("step") if isinstance(section, dict) else None},
                  "checkpoint").step
    if step is not None and step < 0:
        raise UserError(f"config key checkpoint.step = {step}: must be >= 0.")
    return step


def _megatron_export_source(args: argparse.Namespace):
    """(source, tokenizer, its place) of a Megatron checkpoint as an export source: --tokenizer, else
    the tokenizer its args name (a Hugging Face tokenizer folder; data/no_tokenizer.py's value for a
    NullTokenizer run)."""
    from megajax.checkpoint.megatron import megatron_source, megatron_tokenizer
    from megajax.errors import CheckpointError
    if _checkpoint_step(args.overrides, accept_only=True) is not None:
        raise UserError("megajax export: checkpoint.step=N selects a step of a megajax run; a Megatron checkpoint "
                        "names its iteration by its tracker file, or pass --checkpoint DIR/iter_NNNNNNN.")
    found, said = megatron_tokenizer(args.checkpoint, trust=args.trust_checkpoint)
    tokenizer = args.tokenizer or found
    if tokenizer is None:
        raise CheckpointError(f"Megatron checkpoint {args.checkpoint} names no tokenizer megajax can find "
                              f"({said}); pass --tokenizer TOK ('byte', a Hugging Face tokenizer.json, or a "
                              f"directory containing one).")
    return megatron_source(args.checkpoint, trust=args.trust_checkpoint), tokenizer, Path(args.checkpoint)


# export's options that apply to some formats only: (attribute, what it does, the formats it applies to)
EXPORT_ONLY_FOR = {
    "--merge-lora": ("merge_lora", "writes a LoRA run's base with the adapters merged in, a whole model",
                     ("hf", "megatron")),
    "--tensor-parallel": ("tensor_parallel", "splits a legacy Megatron checkpoint over tensor ranks", ("megatron",)),
    "--pipeline-parallel": ("pipeline_parallel", "splits a legacy Megatron checkpoint into pipeline stages", ("megatron",)),
    "--expert-parallel": ("expert_parallel", "splits a legacy Megatron checkpoint's experts over expert ranks",
                          ("megatron",)),
    "--expert-tensor-parallel": ("expert_tensor_parallel", "sets a legacy Megatron checkpoint's experts' tensor "
                                                           "size", ("megatron",)),
    "--ckpt-format": ("ckpt_format", "chooses Megatron's checkpoint format", ("megatron",)),
    "--megatron-version": ("megatron_version", "chooses the megatron-core a torch_dist checkpoint is written for",
                           ("megatron",)),
    "--with-optimizer": ("with_optimizer", "writes the optimizer state for megatron-core", ("megatron",)),
}
EXPORT_DEFAULTS = {"merge_lora": False, "tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
                   "expert_tensor_parallel": None, "ckpt_format": None, "megatron_version": None,
                   "with_optimizer": False}


def _export_options(args: argparse.Namespace, megatron_source: bool) -> None:
    """Refuses an option export would ignore for --format (and --trust-checkpoint without a Megatron
    --checkpoint), then fills in the defaults of the options given as None."""
    from megajax.checkpoint.torch_dist import NEWEST_MEGATRON
    if args.format == "peft" and args.merge_lora:
        raise UserError("--format peft writes a LoRA run's adapters alone (adapter_config.json and "
                        "adapter_model.safetensors, which PEFT loads onto the base's Hugging Face export); "
                        "--merge-lora writes the base with the adapters merged in, a whole model, in --format hf or "
                        "megatron. Choose one: drop --merge-lora, or use --format hf --merge-lora.")
    for option, (attr, what, formats) in EXPORT_ONLY_FOR.items():
        value = getattr(args, attr)
        if value != EXPORT_DEFAULTS[attr] and args.format not in formats:
            shown = "" if isinstance(value, bool) else f" {value}"
            raise UserError(f"{option}{shown} {what}: it applies to --format "
                            f"{' and '.join(formats)}, not to --format {args.format}; drop it.")
    if args.trust_checkpoint and not megatron_source:
        raise UserError(f"--trust-checkpoint unpickles a Megatron checkpoint's files; --checkpoint "
                        f"{args.checkpoint} is not a Megatron checkpoint; drop it.")
    args.ckpt_format = args.ckpt_format or "torch_dist"
    if args.megatron_version is not None and args.ckpt_format != "torch_dist":
        raise UserError(f"--megatron-version {args.megatron_version} chooses the form of a torch_dist "
                        f"checkpoint; --ckpt-format torch writes the legacy per-rank files; drop one of them.")
    args.megatron_version = args.megatron_version or NEWEST_MEGATRON


def cmd_export(args: argparse.Namespace) -> int:
    from megajax.checkpoint.manager import CheckpointSource, read_meta
    from megajax.checkpoint.megatron import is_megatron_checkpoint
    _check_outputs(("--output", args.output), directory=True)
    megatron_source = is_megatron_checkpoint(args.checkpoint)
    _export_options(args, megatron_source)
    if args.with_optimizer and args.ckpt_format != "torch_dist":
        raise UserError("--with-optimizer writes megatron-core's optimizer state into a torch_dist "
                        "checkpoint: it goes with --format megatron and --ckpt-format torch_dist (the default).")
    if megatron_source:
        if args.with_optimizer:
            raise UserError(f"--with-optimizer writes the optimizer state of a megajax run's "
                            f"checkpoint; {args.checkpoint} is a Megatron checkpoint (continue it in Megatron-LM "
                            f"as it is).")
        from megajax.checkpoint.megatron import megatron_dtype
        source, tokenizer, where = _megatron_export_source(args)
        meta, precision = {}, megatron_dtype(args.checkpoint, trust=args.trust_checkpoint)
        dtype_said = f"the checkpoint's {precision}"
    else:
        from megajax.checkpoint.dtypes import run_export_dtype
        source = CheckpointSource(args.checkpoint, step=_checkpoint_step(args.overrides, accept_only=True))
        meta, where = read_meta(source.step_dir), source.step_dir
        # a PEFT export is the adapters, with the run's tokenizer beside them when it is found (as
        # transformers' Trainer saves an adapter); a whole model's export needs one
        tokenizer = _export_tokenizer(args, meta, source.step_dir, required=args.format != "peft")
        trained = meta["config"].get("train", {}).get("precision")
        precision, dtype_said = run_export_dtype(trained), f"the run's train.precision={trained or 'fp32'}"
    if args.dtype is None:  # the weights as the run kept them; --dtype chooses another
        args.dtype, dtype_said = precision, f"{precision} weights, as {dtype_said}; --dtype to choose"
    else:
        dtype_said = f"{args.dtype} weights (--dtype)"
    from megajax.data.no_tokenizer import is_no_tokenizer, no_tokenizer_eod
    carried, eod = None, None  # what the summary line says of a tokenizer not carried
    if tokenizer is not None and is_no_tokenizer(tokenizer):
        eod = no_tokenizer_eod(tokenizer)
        carried = f"no tokenizer carried: trained without one {tokenizer[len('none '):]}; --tokenizer TOK adds one"
        tokenizer = None
    # the template the model speaks goes with its tokenizer (the byte tokenizer's of a chat fine-tuning too)
    from megajax.data.chat import trained_chat_template
    from megajax.data.tokenizer import load_tokenizer
    template = None if tokenizer is None else trained_chat_template(
        load_tokenizer(tokenizer, key="--tokenizer"), meta.get("config", {}).get("data", {}).get("format", "gpt"))
    lora = getattr(source.model, "lora", None)
    if lora is None and (args.merge_lora or args.format == "peft"):
        raise UserError(f"{'--merge-lora' if args.merge_lora else '--format peft'} exports the "
                        f"adapters of a LoRA run (model.lora); {where} has none.")
    if lora is not None:
        if args.format != "peft" and not args.merge_lora:
            raise UserError(f"{where} holds LoRA adapters, not a whole model: export them with "
                            f"--format peft, or the merged model with --format {args.format} --merge-lora.")
        if args.with_optimizer:
            raise UserError(f"--with-optimizer with --merge-lora: {where}'s optimizer state is its "
                            f"adapters' (the base was frozen), which megatron-core cannot load for the merged "
                            f"model; export the merged model without it.")
        from megajax.checkpoint.lora import MergedSource, read_adapters
        from megajax.checkpoint.peft import export_peft
        from megajax.checkpoint.lora_base import base_source as lora_base_source
        base, base_source = lora_base_source(meta.get("lora_base"), str(where))
        if args.format == "peft":
            out = export_peft(read_adapters(source), base_source.model, lora, args.output, base=str(base),
                              dtype=args.dtype, tokenizer_spec=tokenizer, chat_template=template)
            print(f"megajax export: {where} -> {out} (peft, rank {lora.rank}, alpha {lora.alpha:g}, {dtype_said}; "
                  f"base {base}; {carried or _tokenizer_said(tokenizer, out)})")
            return 0
        source = MergedSource(base_source, read_adapters(source), lora)
    if args.format == "hf":
        from megajax.checkpoint.hf import export_hf, mtp_left_out
        from megajax.checkpoint.hf_processor import processor_left_out
        out = export_hf(source, args.output, tokenizer_spec=tokenizer, dtype=args.dtype, chat_template=template,
                        eos_id=eod)
        for note in (mtp_left_out(source.model), processor_left_out(source.model, tokenizer)):
            if note:
                print(f"note: {note}", file=sys.stderr)
        fmt = args.format
    else:
        from megajax.checkpoint.megatron import common_state_form, export_megatron, export_torch_dist, mtp_differs
        step = int(meta.get("step", 0))
        iteration = step if step >= 1 else None
        if args.ckpt_format == "torch":
            out = export_megatron(source, args.output, tensor_parallel=args.tensor_parallel,
                                  pipeline_parallel=args.pipeline_parallel, expert_parallel=args.expert_parallel,
                                  dtype=args.dtype, iteration=iteration, tokenizer_spec=tokenizer,
                                  expert_tensor_parallel=args.expert_tensor_parallel, chat_template=template,
                                  null_eod=eod)
            fmt = "megatron, legacy torch format"
        else:
            if (args.tensor_parallel, args.pipeline_parallel, args.expert_parallel) != (1, 1, 1) or \
                    args.expert_tensor_parallel is not None:
                raise UserError("--tensor-parallel, --pipeline-parallel, --expert-parallel and "
                                "--expert-tensor-parallel split "
                                "a legacy (--ckpt-format torch) checkpoint; a torch_dist one holds global tensors "
                                "that megatron-core loads at any TP/PP/EP, so it takes none of them.")
            form = common_state_form(args.megatron_version)
            adam = None
            if args.with_optimizer:
                from megajax.checkpoint.megatron_optimizer import checkpoint_adam
                adam = checkpoint_adam(source.step_dir, meta)
            out = export_torch_dist(source, args.output, dtype=args.dtype, iteration=iteration,
                                    tokenizer_spec=tokenizer, megatron_version=args.megatron_version, adam=adam,
                                    chat_template=template, null_eod=eod)
            fmt = (f"megatron, torch_dist for megatron-core {args.megatron_version}: common state "
                   + ("in common.pt" if form == "common.pt" else "as common_state in the shards")
                   + ("" if adam is None else f"; with the optimizer state (Adam moments"
                      f"{'' if args.dtype == 'fp32' else ', fp32 main parameters'}, step {adam.count})"))
        if mtp_differs(source.model):
            print(f"note: {mtp_differs(source.model)}", file=sys.stderr)
    tok_dir = out / "tokenizer" if args.format == "megatron" else out
    print(f"megajax export: {where} -> {out} ({fmt}, {dtype_said}; {carried or _tokenizer_said(tokenizer, tok_dir)})")
    return 0


def _tokenizer_said(tokenizer: str | None, written: Path) -> str:
    """The export line's words on the tokenizer written to `written`: which, and whether a chat template went."""
    if tokenizer is None:
        return "no tokenizer (the run's is not found here; the base's export carries one)"
    from megajax.data.chat_template import folder_chat_template
    template = "with its chat template" if folder_chat_template(written) else "no chat template"
    return f"tokenizer {tokenizer}, {template}"


def _import_peft(args: argparse.Namespace) -> int:
    """A PEFT LoRA adapter directory -> a megajax LoRA checkpoint naming its base."""
    from megajax.checkpoint.peft import import_peft_checkpoint
    with removed_on_failure(args.output, Path(args.output) / "checkpoints"):
        step_dir, lora, base = import_peft_checkpoint(args.input, args.base, args.output)
    print(f"megajax import: {args.input} -> {step_dir} (LoRA rank {lora.rank}, alpha {lora.alpha:g}, targets "
          f"{', '.join(lora.targets)}; base {base})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from megajax.checkpoint.common import imported_tokenizer
    from megajax.checkpoint.manager import find_step_dir, write_params_checkpoint
    from megajax.config import load_config
    _check_outputs(("--output", args.output), directory=True)
    if args.base is not None and args.format != "peft":
        raise UserError(f"--base {args.base} names the base model of a PEFT adapter (--format peft); "
                        f"--format {args.format} imports a whole model and takes no base; drop it.")
    if args.trust_checkpoint and args.format != "megatron":
        raise UserError(f"--trust-checkpoint unpickles a Megatron checkpoint's files (--format "
                        f"megatron); --format {args.format} reads no pickle; drop it.")
    out = Path(args.output)
    if out.is_dir() and find_step_dir(out) is not None:
        raise UserError(f"--output {args.output} already holds a megajax checkpoint; choose an empty directory.")
    if out.is_dir() and any(out.iterdir()):  # the input's own directory, another program's files: not mixed into
        held = sorted(p.name for p in out.iterdir())
        raise UserError(f"--output {args.output}: the directory is not empty (it holds {', '.join(held[:4])}"
                        f"{f' and {len(held) - 4} more' if len(held) > 4 else ''}); the import writes a run directory "
                        f"of its own: choose a new or empty directory.")
    if args.format == "peft":
        return _import_peft(args)
    if args.format == "hf":
        from megajax.checkpoint.hf import hf_tokenizer, import_hf
        overrides, params = import_hf(args.input)
        found, known = hf_tokenizer(args.input)
    else:
        from megajax.checkpoint.megatron import import_megatron, megatron_tokenizer
        overrides, params = import_megatron(args.input, trust=args.trust_checkpoint)
        found, known = megatron_tokenizer(args.input, trust=args.trust_checkpoint)
    tokenizer, warning = imported_tokenizer(found, overrides["vocab_size"], known)
    base = {"model": overrides, "data": {"tokenizer": tokenizer}}
    if overrides.get("max_position_embeddings"):
        base["train"] = {"seq_len": min(overrides["max_position_embeddings"], 2048)}
    cfg = load_config(base=base)
    with removed_on_failure(args.output, Path(args.output) / "checkpoints"):
        step_dir = write_params_checkpoint(params, cfg, args.output)
    print(f"megajax import: {args.input} -> {step_dir} (tokenizer {tokenizer}); fine-tune with "
          f"checkpoint.load={args.output} (the model.* settings come from its meta).")
    if warning:
        print(f"megajax import: warning: {warning}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from megajax.config import load_config
    from megajax.perf import planner
    _check_outputs(("--json", args.json), ("--output", args.output))
    cfg = load_config(args.config, args.overrides)
    report = planner.plan_cluster(cfg, args.cluster, args.device_kinds, args.top, planner.kept_keys(args.overrides))
    print(planner.format_plan(report, args.top))
    if args.json:
        from megajax.perf.bench import write_json
        write_json({**report, "ranked": [planner.asdict(c) for c in report["ranked"][:args.top]],
                    "smallest": [planner.asdict(c) for c in report["smallest"]],
                    "alternatives": {a: planner.asdict(c) for a, c in report["alternatives"].items()}}, args.json)
    if not report["ranked"]:
        print(f"megajax plan: nothing fits {args.cluster}: every layout needs more than "
              f"{report['capacity'] / planner.GIB:.1f} GiB per device" + (f"; {args.output} not written" if args.output
                                                                        else ""), file=sys.stderr)
        return 1
    if args.output:
        best = report["ranked"][0]
        command = " ".join(["megajax plan", *(f"--config {c}" for c in args.config), "--cluster", args.cluster,
                            *args.overrides])
        header = (f"{command}\nestimated {best.step_seconds:.3f} s/step, MFU {best.mfu:.1%}, "
                  f"{best.memory['total'] / planner.GIB:.1f} GiB per device: {best.label()}")
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(planner.mesh_yaml(best, header))
        except OSError as e:
            raise ConfigError(f"--output {args.output}: cannot write the mesh config there ({e.strerror}).") from None
        print(f"wrote {args.output}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from megajax.config import load_config
    _check_outputs(("--json", args.json), ("--plot", args.plot))
    cfg = load_config(args.config, args.overrides)
    if args.topology:
        from megajax.perf.bench import format_topology, topology_estimate, write_json
        report = topology_estimate(cfg, args.topology)
        print(format_topology(report))
        if args.json:
            write_json(report, args.json)
        return 0
    if args.gemm_table:
        return _gemm_table(cfg, args.gemm_table)
    _prepare_xla(cfg.mesh.cpu_devices, tensor_overlap=_tensor_overlap(cfg))
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


def _gemm_table(cfg, path: str) -> int:
    """`megajax bench --gemm-table FILE.yaml`: matmul throughput by shape on this machine's first device,
    written as a --device-kinds file for `megajax plan`."""
    import jax
    from megajax.perf import gemm
    from megajax.precision.policy import precision_policy
    from megajax.train.flops import peak_tflops_per_device
    _check_outputs(("--gemm-table", path))
    device = jax.devices()[0]
    key = precision_policy(cfg).peak_flops_key
    dtype = "float32" if device.platform == "cpu" or key == "fp32" else "bfloat16"
    # On CPU a lone matmul has all of the host's cores: its share is of the host's peak. The shares are
    # of the measured dtype's peak (the table's gemm_precision; FP8 products scale by the kind's ceilings).
    precision = "fp32" if dtype == "float32" else "bf16"
    peak, source = peak_tflops_per_device(getattr(device, "device_kind", ""), device.platform, precision, 1,
                                          cfg.train.peak_tflops if key == precision else None)
    measured = gemm.measure(dtype)
    # The memory bandwidth and fixed costs: on CPU per simulated device of the kind (they share the host).
    from megajax.perf.device_kinds import cpu_device_kind
    probes = gemm.measure_probes(cpu_device_kind().node_size if device.platform == "cpu" else 1)
    kind, text = gemm.table_yaml(measured, peak, source, "megajax bench --gemm-table " + path, probes, precision)
    for m, k, n, tflops in measured["rows"]:
        print(f"  [{m:>5} x {k:>5}] x [{k:>5} x {n:>5}]  {tflops:8.3f} TFLOP/s  {tflops / peak:6.1%} of peak")
    for name, value in probes.items():
        print(f"  {name} {value:.4g}")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        raise ConfigError(f"--gemm-table {path}: cannot write the table there ({e.strerror}).") from None
    print(f"wrote {path} (device kind {kind}: megajax plan --device-kinds {path} --cluster Nx{kind})")
    return 0


def _sampling(args: argparse.Namespace):
    from megajax.inference.sampling import Sampling
    s = Sampling(args.temperature, args.top_k, args.top_p, args.seed).check(
        {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"})
    if s.temperature == 0 and (s.top_k or s.top_p < 1):
        raise UserError(f"--top-k {s.top_k} / --top-p {s.top_p} need sampling; with --temperature 0 (the default) "
                        f"decoding is greedy. Pass --temperature T > 0 (e.g. 1.0).")
    return s


def _model_config(args: argparse.Namespace):
    """(source, config) of the model named by --checkpoint / --hf with the key=value overrides (no weights
    read, no device touched)."""
    from megajax.inference.load import find_source, generation_config
    source = find_source(args.checkpoint, args.hf, _checkpoint_step(args.overrides), args.adapter)
    return source, generation_config(source, args.overrides)


def _load_model(args: argparse.Namespace, source=None, cfg=None):
    """The model named by --checkpoint / --hf with the key=value overrides, on this machine's devices."""
    if source is None:
        source, cfg = _model_config(args)
    _prepare_xla(cfg.mesh.cpu_devices, tensor_overlap=_tensor_overlap(cfg))
    from megajax.inference.load import load_model
    loaded = load_model(cfg, source, user_mesh=any(o.startswith("mesh.") for o in args.overrides))
    for note in loaded.notes:
        print(f"megajax {args.command}: {note}", file=sys.stderr)
    return loaded


def cmd_generate(args: argparse.Namespace) -> int:
    import json
    from megajax.data.chat import trained_chat_template
    from megajax.inference.chat import read_chat_template
    from megajax.inference.images import read_image
    from megajax.inference.prompts import check_markers, prompt_texts, read_prompts
    prompts = read_prompts(args.prompt, args.prompts_file, args.chat)
    sampling = _sampling(args)
    _check_outputs(("--json", args.json))
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1.")
    if args.chat_template and all(p.messages is None for p in prompts):
        raise UserError(f"--chat-template {args.chat_template!r} renders conversations, and these prompts are plain "
                        f"text: add --chat (each --prompt, or each line, one user message), or give \"messages\" "
                        f"lines in a .jsonl --prompts-file.")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    pictures = [read_image(path) for path in args.image]  # unreadable files fail before the model loads
    source, cfg = _model_config(args)
    if any(p.messages is not None for p in prompts):
        from megajax.data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        texts = prompt_texts(prompts, tokenizer, template or trained_chat_template(tokenizer, cfg.data.format),
                             len(pictures))
    else:
        texts = [p.text for p in prompts]
    check_markers(texts, prompts, args.image, cfg.model.vision)
    loaded = _load_model(args, source, cfg)
    images = tiles = None
    if pictures:
        import numpy as np
        from megajax.inference.images import preprocess_tiles
        pictures = [preprocess_tiles(p, loaded.cfg.model.vision) for p in pictures]  # [tiles, H, W, 3] each
        images, tiles = np.concatenate(pictures), [len(p) for p in pictures]
    from megajax.inference.text import complete
    results = complete(loaded.generator, loaded.tokenizer, texts, sampling, args.max_new_tokens, args.batch_size,
                       images, tiles=tiles)
    for i, (r, p) in enumerate(zip(results, prompts)):
        if p.messages is not None:
            r["messages"] = p.messages
        print(f"=== prompt {i}: {len(r['prompt_ids'])} tokens + {len(r['completion_ids'])} new ({r['finish_reason']})")
        print(r["prompt"] + r["text"])
    first = results[0]
    print(f"megajax generate: {len(results)} prompt{'s' * (len(results) != 1)} on {loaded.mesh_text} in batches of up to {args.batch_size}; "
          f"first batch: time to first token {first['time_to_first_token_s'] * 1e3:.1f} ms, decode "
          f"{first['decode_tokens_per_s']:,.0f} tokens/s, compile {first['compile_s']:.1f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in results) + "\n]\n")
        print(f"json: {args.json}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.max_batch < 1:
        raise UserError(f"--max-batch {args.max_batch}: must be >= 1.")
    if not 0 <= args.drain_timeout < float("inf"):
        raise UserError(f"--drain-timeout {args.drain_timeout:g}: must be a number of seconds >= 0 (0: cut the "
                        f"requests in progress at once).")
    from megajax.inference.engine import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_CHUNK, check_engine_sizes
    continuous_only = [f"--{name.replace('_', '-')}" for name in ("block_size", "num_kv_blocks", "prefill_chunk",
                                                                    "prefill_rows") if getattr(args, name) is not None]
    if args.enable_prefix_caching is not None:
        continuous_only.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.batching == "static" and continuous_only:
        raise UserError(f"{', '.join(continuous_only)} with --batching static: {'they set' if len(continuous_only) > 1 else 'it sets'} "
                        f"the continuous engine's paged KV cache and prefill, which the static batcher does not "
                        f"have; drop {'them' if len(continuous_only) > 1 else 'it'}, or use --batching continuous.")
    args.block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
    args.prefill_chunk = DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk
    args.enable_prefix_caching = args.enable_prefix_caching is not False
    # The ranges that need no model now; --block-size against the context once the model is loaded.
    check_engine_sizes(sys.maxsize, args.max_batch, args.block_size, args.num_kv_blocks, args.prefill_chunk,
                       args.prefill_rows)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: must be a TCP port, 1..65535, or 0 (any free port).")
    from megajax.inference.chat import read_chat_template
    template = read_chat_template(args.chat_template) if args.chat_template else None
    loaded = _load_model(args)
    from megajax.inference.server import serve
    serve(loaded, host=args.host, port=args.port, max_batch=args.max_batch, chat_template=template,
          drain_timeout=args.drain_timeout, log_requests=not args.disable_log_requests,
          batching=args.batching, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
          prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
          prefix_caching=args.enable_prefix_caching,
          limit_images=args.limit_images_per_prompt, allowed_local_media_path=args.allowed_local_media_path,
          chat_template_source=f"--chat-template {args.chat_template}" if args.chat_template else "")
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR", help="a megajax run directory (its latest checkpoint) or one "
                                                       "step's directory")
    p.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (LlamaForCausalLM or GPT2LMHeadModel "
                                               "with its tokenizer), imported on the fly")
    p.add_argument("--adapter", metavar="DIR", help="LoRA adapters merged into the model at load: a megajax LoRA "
                                                    "checkpoint or a PEFT adapter directory (adapter_config.json)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. mesh.tensor=4 train.precision=fp32 data.tokenizer=PATH; "
                        "checkpoint.step=N reads step N of the run instead of its latest")


def cmd_config(args: argparse.Namespace) -> int:
    """`megajax config from-megatron -- ARGS...`: the YAML on stdout (its comments name each key's Megatron
    flag, and list the flags that needed nothing or were not mapped), checked by megajax's config loader and
    planned as `megajax train` plans it (on --world-size devices). What Megatron's own parse_args /
    validate_args would refuse is refused here too."""
    from megajax.config import load_config
    from megajax.errors import ConfigError
    from megajax.megatron_args import translate
    if not args.megatron:
        raise UserError("megajax config from-megatron needs Megatron-LM pretrain_gpt.py arguments after --, "
                        "e.g. megajax config from-megatron -- --num-layers 32 --hidden-size 4096 --bf16.")
    if args.world_size is not None and args.world_size < 1:
        raise UserError(f"--world-size {args.world_size}: must be >= 1 (the job's GPU count, Megatron's WORLD_SIZE).")
    if any(w.split("=")[0] == "--world-size" for w in args.megatron):
        raise UserError("--world-size is megajax's option, not a Megatron flag: put it before the -- (megajax config "
                        "from-megatron --world-size N -- ARGS...).")
    t = translate(args.megatron)
    if t.refused:
        raise UserError("Megatron-LM would refuse these arguments (its parse_args / validate_args), so they are not "
                        "translated: " + "; ".join(f"{given}: {why}" for given, why in t.refused) + ".")
    behind = ", ".join(dict.fromkeys(o for _, o in t.assignments.values()))
    try:
        cfg = load_config(base=t.tree())
    except ConfigError as e:
        raise UserError(f"the Megatron arguments translate to a config megajax refuses: {e} (Megatron flags "
                        f"behind it: {behind}).") from None
    from megajax.plan import fewest_devices, plan_elsewhere
    n = args.world_size or fewest_devices(cfg)
    on = (f"--world-size {n}" if args.world_size else
          f"{n} device{'s' * (n > 1)}, the fewest its parallel sizes take (--world-size N plans for the job's)")
    try:
        plan = plan_elsewhere(cfg, n)
    except UserError as e:
        raise UserError(f"the Megatron arguments give a run megajax train would refuse on {on}: {e} (Megatron "
                        f"flags behind it: {behind}).") from None
    sys.stdout.write(t.to_yaml())
    b = plan.batch
    print(f"megajax config: {len(t.assignments)} keys set from {len(args.megatron)} words; "
          f"{len(t.needless)} flags need nothing in megajax, {len(t.unmapped)} not mapped (both listed in "
          f"the YAML's comments); planned as megajax train plans it on {on}: mesh {plan.mesh_text()}, global "
          f"batch {b.global_batch} = micro {b.micro_batch} x accumulation {b.accumulation} x data-parallel "
          f"{b.data_parallel}", file=sys.stderr)
    return 0


GIVEN = "_megajax_given"  # the namespace's record of the single-valued options given (dropped after parsing)


def _given_once(action: argparse.Action, namespace: argparse.Namespace, option_string: str | None, values) -> None:
    """UserError when an option that takes one value is given again (argparse keeps the last in silence:
    `--adapter a --adapter b` served b alone, `--format hf --format peft` exported peft)."""
    given = namespace.__dict__.setdefault(GIVEN, {})
    said = f"{option_string} {values}" if action.nargs != 0 else option_string  # a switch has no value
    if action.dest in given:
        raise UserError(f"{given[action.dest]} and {said}: {'/'.join(action.option_strings)} takes one value and "
                        f"is given twice; give it once.")
    given[action.dest] = said


class _Once(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):
        _given_once(self, namespace, option_string, values)
        super().__call__(parser, namespace, values, option_string)


class _OnceSwitch(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        _given_once(self, namespace, option_string, values)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """A verb's parser: its options that take one value refuse a second one (_given_once)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)


def build_parser() -> argparse.ArgumentParser:
    from megajax.checkpoint.dtypes import EXPORT_DTYPES  # light: no JAX before the config is read
    from megajax.checkpoint.torch_dist import MEGATRON_VERSIONS as MEGATRON_FORMS, NEWEST_MEGATRON as MEGATRON_NEWEST
    parser = argparse.ArgumentParser(prog="megajax", description="Megatron-style LLM training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    parser.set_defaults(subparsers=sub.choices)
    p = sub.add_parser("train", help="train a model (no arguments: a small model on an embedded corpus)")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("preprocess", help="tokenize text into a Megatron dataset (.bin/.idx), merge datasets, "
                                          "or write image-text shards (--format webdataset)")
    _add_preprocess_args(p)
    p.set_defaults(func=cmd_preprocess)
    p = sub.add_parser("export", help="write a checkpoint as Hugging Face or Megatron-Core files")
    p.add_argument("--format", choices=("hf", "megatron", "peft"), required=True,
                   help="hf, megatron, or peft (a LoRA run's adapters as a PEFT adapter directory)")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run directory (its latest checkpoint) or one step's directory")
    p.add_argument("--merge-lora", action="store_true",
                   help="hf, megatron: a LoRA run's checkpoint written as its base with the adapters merged in "
                        "(W + alpha/rank A B)")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="megatron: split for this TP size")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="N", help="megatron: split into N stages")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="megatron, legacy torch format: split the experts over N expert ranks (mp_rank_TT_EEE)")
    p.add_argument("--expert-tensor-parallel", type=int, default=None, metavar="N",
                   help="megatron, legacy torch format: the experts' tensor size (default the --tensor-parallel "
                        "size; 1: each expert whole, rank files mp_rank_{i mod TP}_{i} as Megatron's MoE "
                        "parallel folding writes them)")
    p.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default=None,
                   help="megatron: torch_dist (global tensors, any TP/PP; default) or the legacy per-rank torch")
    p.add_argument("--megatron-version", default=None, metavar="X.Y",
                   help=f"megatron, torch_dist: the megatron-core whose common-state form to write "
                        f"({', '.join(MEGATRON_FORMS)}; default {MEGATRON_NEWEST})")
    p.add_argument("--with-optimizer", action="store_true",
                   help="megatron, torch_dist: also write the run's Adam state (moments, step count; fp32 main "
                        "parameters for bf16/fp16) as megatron-core's optimizer loads it")
    p.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default=None,
                   help="the stored weights' dtype (default: the run's train.precision, fp8 as bf16; a Megatron "
                        "checkpoint's own)")
    p.add_argument("--tokenizer", metavar="TOK", help="the tokenizer the export carries ('byte', a Hugging Face "
                                                     "tokenizer.json or its directory); default: the checkpoint's")
    p.add_argument("--trust-checkpoint", action="store_true", help=f"--checkpoint a Megatron checkpoint: {TRUST_HELP}")
    p.add_argument("overrides", nargs="*", metavar="checkpoint.step=N",
                   help="export step N of the run instead of its latest")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="turn Hugging Face or Megatron-Core weights into a megajax checkpoint")
    p.add_argument("--format", choices=("hf", "megatron", "peft"), required=True)
    p.add_argument("--input", required=True, metavar="DIR")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--base", metavar="DIR", help="--format peft: the base model the adapter belongs to, a megajax "
                                                 "checkpoint or a Hugging Face directory (default: the adapter's "
                                                 "base_model_name_or_path)")
    p.add_argument("--trust-checkpoint", action="store_true", help=f"--format megatron: {TRUST_HELP}")
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
    p.add_argument("--gemm-table", metavar="FILE.yaml", help="measure matmul throughput by shape (M, K, N) on this "
                                                               "machine's device, its memory bandwidth and (with "
                                                               "several devices) a collective's latency, and write "
                                                               "them for megajax plan --device-kinds FILE.yaml (no "
                                                               "train step is run)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("plan", help="choose a mesh for a cluster: every layout estimated (memory, step time), "
                                    "ranked; the best written as a mesh config")
    _add_config_args(p)
    p.add_argument("--cluster", required=True, metavar="NxKIND", help="the devices, e.g. 32xH100 (8 per node)")
    p.add_argument("--output", metavar="FILE.yaml", help="write the best layout as a mesh config "
                                                        "(configs/mesh/*.yaml's form)")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--device-kinds", metavar="FILE.yaml", help="more device kinds, or other figures for known "
                                                              "ones (memory_gib, peak_tflops, node_size, "
                                                              "intra_node_gbps, inter_node_gbps, efficiency, "
                                                              "gemm_efficiency: megajax bench --gemm-table)")
    p.add_argument("--json", metavar="FILE", help="also write the ranked layouts as JSON")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("generate", help="complete prompts with a trained model (KV cache; greedy or sampled)")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", metavar="FILE", help="one prompt per line; .jsonl: per line a JSON string, "
                                                          "an object with \"prompt\", or one with \"messages\" "
                                                          "(a conversation, rendered with the chat template)")
    p.add_argument("--chat", action="store_true", help="each plain prompt is a user message, rendered with the "
                                                       "model's chat template (as megajax serve's chat requests)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for the conversations (default: "
                                                           "the tokenizer's own)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image (repeatable) for a vision-language model: it goes at each prompt's <image> "
                        "marker (before the prompt when it has none)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="new tokens per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt i samples with seed S + i (default 0)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="prompts decoded together (default 16)")
    p.add_argument("--json", metavar="FILE", help="also write the results as a JSON list, one object per prompt")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("serve", help="HTTP text generation: OpenAI /v1/completions and /v1/chat/completions, "
                                     "Megatron's PUT /api")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="concurrent sequences decoded together (default 8)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for /v1/chat/completions "
                                                            "(default: the tokenizer's own, its chat_template.jinja "
                                                            "or tokenizer_config.json's)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds the requests in progress may take to finish while new "
                        "ones are refused (default 30: Kubernetes' grace period)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request on stderr")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous (default): sequences join and leave the running batch at every step, over a "
                        "paged KV cache; static: a batch runs to its end while new requests wait")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="positions per KV cache block (continuous batching; default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks in the pool (continuous batching; default: room for --max-batch "
                        "sequences of the whole context)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled per step, so a long prompt does not stall running decodes "
                        "(continuous batching; default 128, at most the context)")
    p.add_argument("--prefill-rows", type=int, default=None, metavar="N",
                   help="prompts prefilled together per step, so many arriving requests start in a few steps "
                        "(continuous batching; default 4 per data shard, at most --max-batch; rounded up to a "
                        "multiple of the data-parallel size)")
    p.add_argument("--enable-prefix-caching", action=_OnceSwitch, default=None,
                   help="share the KV blocks of prompt prefixes between requests (continuous batching; default "
                        "on; off by itself for models with Mamba layers, not used for requests with images); "
                        "--no-enable-prefix-caching turns it off")
    p.add_argument("--limit-images-per-prompt", type=int, default=None, metavar="N",
                   help="images one chat request may hold (a vision-language model; default 4); they come as "
                        "base64 data URLs, nothing is fetched")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="chat requests may also name images as file:// URLs of files under DIR")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("config", help="translate a Megatron-LM pretrain_gpt.py argument list into a megajax YAML")
    p.add_argument("action", choices=("from-megatron",),
                   help="from-megatron: the arguments after -- are Megatron-LM's; prints the YAML on stdout")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="the job's GPU count (Megatron's WORLD_SIZE): the YAML is planned as megajax train plans it "
                        "on N devices (default: the fewest its parallel sizes take)")
    p.set_defaults(func=cmd_config)
    return parser


def megatron_flags(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """A paragraph for Megatron-LM flags typed as options of a command that takes config overrides, or None."""
    from megajax.megatron_args import lookup, spell
    if not any(a.dest == "overrides" for a in parser._actions):
        return None
    options = {o for a in parser._actions for o in a.option_strings}
    found = []
    for i, token in enumerate(args):
        if token == "--":
            break
        name, eq, value = token.partition("=")
        if not token.startswith("--") or lookup(name) is None or any(o.startswith(name) for o in options):
            continue
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else None
            takes_it = following is not None and not following.startswith("--") and "=" not in following
            value = following if takes_it else None  # not an option, not a key=value override
        found.append(spell(name, value))
    if not found:
        return None
    return "; ".join(found) + " (or: megajax config from-megatron -- ARGS... prints a megajax YAML for a whole " \
                              "Megatron-LM argument list)."


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options and key=value overrides in any order, in every subcommand
    (`megajax train train.steps=1 --config model/tiny train.seq_len=64`)."""
    parser = build_parser()
    commands = parser.get_default("subparsers")
    if argv and argv[0] == "config":  # everything after -- (or not an option of its own) is Megatron's
        cut = argv.index("--") if "--" in argv else len(argv)
        args, extra = commands["config"].parse_known_args(argv[1:cut])
        args.megatron, args.command = extra + argv[cut + 1:], "config"
        return args
    if argv and argv[0] in commands:
        message = megatron_flags(commands[argv[0]], argv[1:])
        if message:
            raise UserError(message)
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.__dict__.pop(GIVEN, None)
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # no or unknown command: argparse's usage and error


def _paragraph(error: Exception, command: str) -> str:
    """The error's message as one line, without a "megajax: " or "megajax COMMAND: " of its own (the line
    already starts with "megajax COMMAND: error:")."""
    text = re.sub(r"\s+", " ", str(error)).strip()
    return re.sub(rf"^megajax(?: {re.escape(command)})?: ", "", text)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a program: restart once with huge-page malloc (megajax/host_allocator.py)
        from megajax import host_allocator
        host_allocator.reexec_with_huge_pages(sys.argv[1:])
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UserError as e:  # Megatron-LM flags typed as options
        print(f"megajax {argv[0]}: error: {_paragraph(e, argv[0])}", file=sys.stderr)
        return 2
    args.argv = argv
    previous = _stop_on_sigterm()
    hook = sys.unraisablehook
    sys.unraisablehook = _stops_sent_again(hook)
    try:
        return args.func(args)
    except UserError as e:
        print(f"megajax {args.command}: error: {_paragraph(e, args.command)}", file=sys.stderr)
        return 2
    except Exception as e:  # an allocation no machine could make: one paragraph, not a traceback
        said = _out_of_memory(e)
        if said is None:
            raise
        print(f"megajax {args.command}: error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated); what was being written is removed
        terminated = isinstance(e, Terminated)
        print(f"megajax {args.command}: stopped by {'SIGTERM' if terminated else 'Ctrl-C (SIGINT)'} before it "
              f"finished; nothing it was writing was left behind.", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        sys.unraisablehook = hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stops_sent_again(hook):
    """sys.unraisablehook while a verb runs: a Ctrl-C or SIGTERM whose exception Python ignored (raised while a
    garbage-collection callback or a destructor ran, where exceptions are printed and dropped) is not printed,
    and its signal is sent again 50 ms later, so the stop is never lost; anything else goes to `hook`."""
    import threading

    def resend(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return hook(unraisable)
        sig = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT
        timer = threading.Timer(0.05, os.kill, (os.getpid(), sig))
        timer.daemon = True
        timer.start()
    return resend


def _out_of_memory(error: Exception) -> str | None:
    """The one paragraph for an allocation that failed (numpy's MemoryError, XLA's RESOURCE_EXHAUSTED), or None
    for any other error. The checks before the work name the sizes they know (the fit check, the KV pool,
    the data indices); this is what is said of any other."""
    text = re.sub(r"\s+", " ", str(error)).strip()
    if isinstance(error, MemoryError):
        where = "host memory"
    elif type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and text.startswith("RESOURCE_EXHAUSTED"):
        where, text = "device memory", text.removeprefix("RESOURCE_EXHAUSTED:").strip()
    else:
        return None
    text = text[:300].rstrip(".") + ("..." if len(text) > 300 else "")
    return (f"out of {where}: {text}. A size this command was given (a "
            f"config key, an option, a file's header) asks for more memory than the machine has.")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s stop), raised in the main thread as Ctrl-C raises KeyboardInterrupt,
    so every verb stops the same way: outputs being written are removed on the way out (their `finally`
    and `except BaseException` blocks), one line says so, exit status 143. `megajax train` and `megajax
    serve` install their own handlers while they run (a checkpoint, a drain) and restore this one."""


def _stop_on_sigterm():
    """Installs the SIGTERM handler raising Terminated; returns the handler it replaced (None off the main
    thread, where signals cannot be handled)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise Terminated()
    return signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
