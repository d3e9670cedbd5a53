"""Rich tables of each analysis Result, one module per analysis (like figures/): the CLI prints
them and the report embeds them, so both show the same numbers the same way."""
