"""Help that lists every recipe and job option, read from their tables only when help is asked for."""

from __future__ import annotations

import click

__all__ = ["ListsRecipes"]


class ListsRecipes(click.Command):
    """A command whose `--help` ends with the recipes and the job options (`app.recipes.help_text`)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from pipeline.app.recipes import help_text

        super().format_epilog(ctx, formatter)
        formatter.write("\n")
        for line in help_text().splitlines():
            formatter.write(f"  {line}\n" if line else "\n")
