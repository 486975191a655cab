"""The ``moetune`` command: one file per subcommand, each thin (parse, call the library, print)."""
