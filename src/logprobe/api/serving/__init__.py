"""The serving core, shared by every endpoint: the registry of endpoints, the pipeline that runs one
(parse, tokenize, check, hold, run, format), admission and holding, the decision of a `choice` list, and
the output blocks the endpoints share."""
