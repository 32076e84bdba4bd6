"""Chat templates and (later) tool-call and reasoning parsers; imports no torch."""
