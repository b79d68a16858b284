"""POST /v1/chat/completions: its body and messages (`protocol`) and how it is served (`serving`)."""
