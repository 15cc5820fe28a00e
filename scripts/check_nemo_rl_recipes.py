"""Translate every LLM GRPO recipe of a NeMo-RL checkout and print pass / fail per recipe (no torch, no model).

    python scripts/check_nemo_rl_recipes.py /path/to/NeMo-RL [--verbose]

The recipes are examples/configs/grpo_*.yaml and examples/configs/recipes/llm/grpo-*.yaml (vision and audio
ones excluded); each goes through grpo.nemo_rl_recipe.load_recipe as `--check-config` would. A failure prints
the keys grpo-ds refuses, each with why. Exit status 0 when every recipe passes, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.config_load import ConfigError  # noqa: E402
from grpo.nemo_rl_recipe import load_recipe  # noqa: E402


def recipes(root: Path) -> list[Path]:
    configs = root / "examples" / "configs"
    found = sorted(configs.glob("grpo_*.yaml")) + sorted((configs / "recipes" / "llm").glob("grpo-*.yaml"))
    return [p for p in found if not any(w in p.name for w in ("vlm", "audio"))]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    root, verbose = Path(argv[0]), "--verbose" in argv
    paths = recipes(root)
    if not paths:
        print(f"{root}: no examples/configs/grpo_*.yaml here (expected a NeMo-RL checkout)", file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        name = path.relative_to(root / "examples" / "configs")
        try:
            load_recipe(path)
            print(f"pass  {name}")
        except ConfigError as err:
            failed += 1
            lines = str(err).splitlines()
            print(f"FAIL  {name}")
            for line in lines if verbose else lines[:12]:
                print(f"        {line.strip()}")
    print(f"\n{len(paths) - failed} of {len(paths)} recipes pass, {failed} fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
