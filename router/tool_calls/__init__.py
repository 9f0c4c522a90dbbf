"""Tool calls on chat completions: the domain objects (`types`), the checks of a request's
tools and tool choice and the grammar that forces calls (`plan`), and the parsers that find
calls in a choice's output as it streams (`parsers`). Used by the router's front, so gRPC
and HTTP clients get the same parsed calls; `router.tool_requests` applies them to a
request."""
