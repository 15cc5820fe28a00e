"""The training scripts' command line: flags, overrides and the config check, all of which fail (exit 2) before
torch is imported.

    args, cfg = load_run_config(argv, DEFAULT_CONFIG, asynchronous=False)
"""

from __future__ import annotations

import argparse
import os
import sys

from grpo.config import MasterConfig
from grpo.config.load import ConfigError, config_help, load_config


def parse_args(argv=None, description: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML run config (default: the built-in CPU demo)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="load the latest checkpoint, export consolidated HF safetensors to DIR (a LoRA run: the merged "
                        "model), and exit")
    p.add_argument("--export-adapter", default=None, metavar="DIR",
                   help="(policy.lora runs) load the latest checkpoint, write the LoRA adapter to DIR in peft's layout "
                        "(adapter_config.json + adapter_model.safetensors), and exit")
    p.add_argument("--export-hf-overwrite", action="store_true",
                   help="let --export-hf / --export-adapter write into a non-empty DIR that is not this run's export "
                        "(same-named files are replaced, nothing else is deleted)")
    p.add_argument("--export-allow-config-change", action="store_true",
                   help="let --export-hf / --export-adapter run with a config whose model, precision, tokenizer or "
                        "hf_config_overrides differ from the run's recorded fingerprint (refused otherwise, naming the "
                        "keys; the policy.lora keys are never overridden)")
    p.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION",
                   help="print every config field (key, type, default, description), or those of SECTION, and exit")
    p.add_argument("--check-config", action="store_true",
                   help="print the config as grpo-ds runs it (YAML; for a NeMo-RL recipe also the table of translated "
                        "and ignored keys) and exit: 0 if it is valid, 2 naming the problem (torch is not imported)")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides are dotted.key=value, or ~dotted.key to delete)")
    return args, overrides


def load_run_config(argv=None, default_config: str = "", asynchronous: bool = False,
                    description: str | None = None, config_cls: type[MasterConfig] = MasterConfig,
                    ) -> tuple[argparse.Namespace, MasterConfig]:
    """Parse the command line and validate the config; exits 2 naming the problem before torch is imported.

    ``asynchronous``: the caller is train_async_grpo.py, which runs exactly the configs with
    ``grpo.async_grpo.enabled=true`` (train_grpo.py runs the others). ``config_cls``: the config model,
    `grpo.config.MasterConfig` or a fork's subclass with its own sections (`grpo.config.load.build_config`);
    ``--help-config`` lists its fields.
    """
    args, overrides = parse_args(argv, description)
    if args.help_config is not None:
        try:
            print(config_help(args.help_config or None, config_cls))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    if args.config is None:
        print(f"No --config given: running the built-in {'async ' if asynchronous else ''}CPU demo "
              f"({os.path.relpath(default_config)})", flush=True)
        args.config = default_config
    from grpo.config.nemo_rl.recipe import dump_config, format_table, is_nemo_rl_recipe, load_recipe

    table = None
    try:
        if is_nemo_rl_recipe(args.config):  # NeMo-RL's format, recognised by its shape: translated key by key
            cfg, table = load_recipe(args.config, overrides, config_cls)
        else:
            cfg = load_config(args.config, overrides, config_cls)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.check_config:
        print(dump_config(cfg), end="")
        if table is not None:
            print(f"\n# NeMo-RL recipe {args.config}: {len(table)} keys translated or ignored "
                  "(every other key is honored as is)\n" + format_table(table))
        if cfg.grpo.async_grpo.enabled != asynchronous:
            print(f"# note: run it with {'train_async_grpo.py' if cfg.grpo.async_grpo.enabled else 'train_grpo.py'}")
        sys.exit(0)
    if table is not None and os.environ.get("RANK", "0") == "0":
        print(f"NeMo-RL recipe {args.config}: translated to grpo-ds (python {sys.argv[0]} --config ... --check-config "
              "prints the whole config)\n" + format_table(table), flush=True)
    if cfg.grpo.async_grpo.enabled != asynchronous and not exporting(args):
        wrong = ("train_async_grpo.py needs grpo.async_grpo.enabled=true (train_grpo.py is the synchronous loop)"
                 if asynchronous else
                 "grpo.async_grpo.enabled=true: run train_async_grpo.py (train_grpo.py is the synchronous loop)")
        print(f"error: invalid config:\n  {wrong}", file=sys.stderr)
        sys.exit(2)
    return args, cfg


def exporting(args: argparse.Namespace) -> bool:
    """Whether the command asks for an export (and no training): `grpo.run.export`."""
    return args.export_hf is not None or args.export_adapter is not None


def export_flag(args: argparse.Namespace) -> str:
    """The export flag the command line gave (for messages): ``--export-hf`` or ``--export-adapter``."""
    return "--export-hf" if args.export_hf is not None else "--export-adapter"
