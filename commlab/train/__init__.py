"""A small model on real offline data, so that the labs move real gradients, and the trainers that use it.

Both trainers run on commlab's one data-parallel path, :class:`commlab.overlap.BucketedDataParallel`.
"""

from commlab.train.data import Digits, load_digits_split, shard
from commlab.train.model import DigitsMLP, flat_grad, set_flat_grad
from commlab.train.data_parallel import DataParallelResult, train_data_parallel

__all__ = ["Digits", "load_digits_split", "shard", "DigitsMLP", "flat_grad", "set_flat_grad",
           "DataParallelResult", "train_data_parallel"]
from commlab.train.compressed import CompressedRun, compressed_all_reduce, train_compressed

__all__ += ["CompressedRun", "compressed_all_reduce", "train_compressed"]
