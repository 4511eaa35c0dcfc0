module github.com/memory-sidecar/memory-sidecar/clients/go

go 1.19

// The versions Debian 12 packages (what CI builds against, offline, in
// GOPATH mode); genproto is the one grpc-go 1.33.3's own go.mod names.
require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require github.com/golang/protobuf v1.5.2 // indirect
