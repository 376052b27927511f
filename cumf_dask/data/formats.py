"""The rating file formats ingestion reads, by name, with a line each (``--format``).

Apart from the readers so that the command line lists them without importing pandas.
"""

from __future__ import annotations

FORMATS: dict[str, str] = {
    "csv": "comma-separated user,item,rating[,...]; header guessed unless given",
    "tsv": "tab-separated user, item, rating[, ...]; header guessed unless given",
    "delimited": "any delimiter (--delimiter; default: whitespace)",
    "movielens-100k": "MovieLens 100K u.data: user<TAB>item<TAB>rating<TAB>timestamp",
    "movielens-1m": "MovieLens 1M/10M ratings.dat: user::item::rating::timestamp",
    "movielens-csv": "MovieLens ratings.csv (ml-latest, 20M, 25M): userId,movieId,rating,...",
    "netflix": "Netflix Prize: 'movie_id:' lines, each followed by user,rating,date lines",
    "parquet": "Parquet columns user, item, rating by name, else the first three",
}
