"""mpidp's DistributedDataParallel and what it is built from (``mpidp.DistributedDataParallel``).

The package, one concept a module, from the wrapper down:

- ``data_parallel``: ``DistributedDataParallel``, torch's DDP interface;
- ``options``: its arguments, checked and agreed, turned into a reducer's configuration;
- ``replica``: the ranks' replicas compared, rank 0's values broadcast;
- ``join``: training on uneven inputs (``join()``);
- ``comm_hook``: ``register_comm_hook`` and the bucket statistics;
- ``reducer``: autograd hooks feed buckets, buckets feed allreduces;
- ``sharded``: ZeRO stage 2's reducer (reduce-scatter into shards);
- ``step``: one synced step's state and the searches that arm it;
- ``layout``: where each gradient goes (the bucket layout, moved into shared memory);
- ``buckets``: grouping parameters into buckets, and the bucket;
- ``bucket_launch``: ready buckets handed to communication in bucket order;
- ``overlap``: the overlap strategies (``inline``, ``thread``, ``nonblocking``) that start them;
- ``outcome``: the end of a step, averaged gradients or the same error everywhere;
- ``sparse``: averaging sparse gradients;
- ``syncbn``: ``SyncBatchNorm``.

Collectives start through ``mpidp.comm``; this package only decides what and when.
"""
