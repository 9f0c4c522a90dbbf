"""What every stagemesh service stands on, and nothing that starts a service.

- `modelstore`: the default model fetched and imported once, `--model DIR` resolved;
- `model_config`: a model's shape from its `config.json`; `tokenizer`: its tokenizer and
  chat template;
- `sampling_params`: per-request sampling settings and their validation;
- `tls`, `api_keys`: transport security and caller authentication;
- `ports`: picking a free local port.

Imports no torch (the router and the gateway import this package); sits below `router`,
`stage_worker` and `gateway`, and above nothing of ours but `protos` (see docs/ARCHITECTURE.md).
"""
