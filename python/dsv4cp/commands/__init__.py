"""One module per `dsv4cp` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
