"""tenantq.storage: what one chip stores, between `quant` (the plan) and `engine` (the arrays).

`tp`: the tensor-parallel layout table; `kv`: each layer's KV arrays (`LayerKVStorage`);
`pool`: the page/slot/static sums and `pages_that_fit`. The engine allocates and places from
these, and the capacity planner counts its bytes from them: the same bytes, by construction.
"""
