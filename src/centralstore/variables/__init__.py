"""Central variables: the store (records, scope, sync points), the replicas' views, and the
arithmetic of folding their gradients and writes back."""
