"""The bin/* commands: argument parsing, exit statuses, and the reports and plans they print."""
