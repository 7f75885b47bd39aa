"""What a test file in tests/unit/ and its process-level counterpart in tests/e2e/ share: the builders and fixtures of
one topic, so that neither test module imports the other."""
