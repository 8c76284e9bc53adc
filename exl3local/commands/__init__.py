"""The CLI's subcommands, one module per group: argparse wiring, handlers and printing."""
