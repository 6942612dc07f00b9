from graphdiff.schemas import write

for p in write():
    print(p)
