#!/usr/bin/env python3
"""Generate a small random-weight stack of MoE FFN layers (what MoEStackSession runs) as GGUF.

    python tools/gen_moe_gguf.py OUT.gguf [--layers 4] [--embd 256] [--ff 256] [--experts 16] [--used 4] [--type q4_K]
"""

from __future__ import annotations

import click

from ggml_hybrid.synthetic import write_moe_stack


@click.command(help=__doc__)
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1))
@click.option("--embd", default=256, show_default=True, type=click.IntRange(1))
@click.option("--ff", default=256, show_default=True, type=click.IntRange(1))
@click.option("--experts", default=16, show_default=True, type=click.IntRange(1))
@click.option("--used", default=4, show_default=True, type=click.IntRange(1))
@click.option("--type", "expert_type", default="q8_0", show_default=True)
@click.option("--fused", is_flag=True, help="One ffn_gate_up_exps tensor instead of gate and up.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
def main(out, layers, embd, ff, experts, used, expert_type, fused, seed):
    click.echo(write_moe_stack(out, layers, embd, ff, experts, used, expert_type, fused, seed))


if __name__ == "__main__":
    main()
