module example.com/memoryclient

go 1.19
