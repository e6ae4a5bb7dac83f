module github.com/fencedlease/fencedlease/clients/go

go 1.24
