"""MovieLens 100k ratings (tfds ``movielens/100k-ratings``) as a ranking task.

For users with network access (Colab): tfds downloads the data on first use.
``columns`` maps an example to the columns a spec's features read: ``user``
and ``movie`` (string ids hashed into ``USER_BUCKETS`` / ``MOVIE_BUCKETS``),
``genres`` (multi-hot genre ids), ``occupation``; ``dense`` (age bucket and
gender, scaled to about [0, 1]); ``label`` = rating >= 4. CI tests it with
``tfds.testing.mock_data`` (no network).
"""

import tensorflow as tf

__all__ = ["columns", "USER_BUCKETS", "MOVIE_BUCKETS", "NUM_GENRES", "NUM_OCCUPATIONS"]

USER_BUCKETS = 1000    # 943 users.
MOVIE_BUCKETS = 2000   # 1,682 movies.
NUM_GENRES = 21
NUM_OCCUPATIONS = 22


def columns(example):
  """One example's columns; ids are variable-length int64 lists."""
  return {
      "user": tf.strings.to_hash_bucket_fast([example["user_id"]], USER_BUCKETS),
      "movie": tf.strings.to_hash_bucket_fast([example["movie_id"]], MOVIE_BUCKETS),
      "genres": tf.cast(example["movie_genres"], tf.int64),
      "occupation": tf.cast([example["user_occupation_label"]], tf.int64),
      "dense": tf.stack([tf.cast(example["bucketized_user_age"], tf.float32) / 60.0,
                         tf.cast(example["user_gender"], tf.float32)]),
      "label": tf.cast(example["user_rating"] >= 4.0, tf.int64),
  }
