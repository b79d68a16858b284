"""POST /v1/responses: its body (`protocol`), how it is served (`serving`) and streamed (`stream`)."""
