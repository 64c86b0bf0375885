"""The cluster's I/O: the `kvpool conductor` gateway (OpenAI front, relay to the instances,
member polling, metrics) and the local-cluster launcher, driving the pure `kvpool.conductor`."""
