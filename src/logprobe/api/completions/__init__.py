"""POST /v1/completions: its body (`protocol`) and how it is served (`serving`)."""
