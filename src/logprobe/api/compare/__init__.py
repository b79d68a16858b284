"""POST /v1/compare: its body (`protocol`), two models on the same tokens (`serving`), and two or more
models on the spans of one text (`spans`, `align: "text"`)."""
