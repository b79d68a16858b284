"""POST /v1/tree: its body (`protocol`) and how it is served (`serving`)."""
