"""POST /v1/score: its body (`protocol`, `fields`), how it is served (`serving`) for texts, conversations
(`conversation`), constrained texts (`constrained`) and per-position ids (`position_ids`)."""
