"""mpidp's DistributedDataParallel and what it is built from (``mpidp.DistributedDataParallel``).

The package, one concept a module, from the wrapper down:

- ``data_parallel``: ``DistributedDataParallel``, torch's DDP interface;
- ``options``: its arguments, checked and agreed, turned into a reducer's configuration;
- ``replica``: the ranks' replicas compared, rank 0's values broadcast;
- ``join``: training on uneven inputs (``join()``), a part the wrapper holds;
- ``comm_hook``: the comm hook and ``record_stats``, a part the wrapper holds;
- ``reducer``: autograd hooks feed buckets, buckets feed allreduces;
- ``sharded``: ZeRO stage 2's reducer (reduce-scatter into shards);
- ``step``: one synced step's state and the searches that arm it;
- ``layout``: where each gradient goes (the bucket layout, moved into shared memory), a part
  the reducer holds;
- ``buckets``: grouping parameters into buckets, and the bucket;
- ``packing``: how a bucket's gradients get into its buffer (one call, or a copy each);
- ``bucket_launch``: ready buckets handed to communication in bucket order, a part the
  reducer holds;
- ``overlap``: the overlap strategies (``inline``, ``thread``, ``nonblocking``) that start them;
- ``outcome``: the end of a step, averaged gradients or the same error everywhere;
- ``sparse``: averaging sparse gradients;
- ``syncbn``: ``SyncBatchNorm``.

Collectives start through ``mpidp.comm``; this package only decides what and when.
"""
