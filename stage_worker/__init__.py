"""A stage worker: a contiguous slice of the model's layers, tensor-parallel inside, with
its own physical paged KV pool; samples on the last stage."""
