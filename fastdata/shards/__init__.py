"""On-disk shard formats: WebDataset-style tar shards and HDF5 shards.

Heavy optional imports (h5py) happen only in :mod:`fastdata.shards.hdf5`.
"""
