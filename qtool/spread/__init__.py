"""Runs spread past one process: shard jobs (`shard_job`), the executors that run them on local
worker processes or a Ray cluster (`executors`, `ray_executor`), and the driver that splits a
plan into jobs and gathers their results (`distribute`). They move opaque shard jobs and know no
file format."""
