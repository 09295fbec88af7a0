"""From MDS shards to batches: the streaming dataset that reads samples in place
(`mds_reader`), the training loader (`loader`), batch collation into shared buffers
(`collation`, `shared_batch_buffers`), image bytes to pixels (`images`), captions to token ids
(`tokenization`), and streaming's leftovers of killed processes (`stale_streaming_files`)."""
